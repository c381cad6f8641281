"""Smoke test of an installed tritonnorm: the Triton kernels, forward and backward, on CPU
tensors under Triton's interpreter, against the formula in plain PyTorch.

Run it as ``TRITON_INTERPRET=1 python smoke_tritonnorm.py`` in an environment with
``tritonnorm[interpret]`` installed (the interpreter needs numpy). Where ``tritonnorm[bench]``
is installed too, ``lab2bench norm --quick`` runs tritonnorm's suite.
"""

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import torch

import tritonnorm

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1: Triton reads it when tritonnorm is imported")
torch.manual_seed(0)
x = torch.randn(4, 64, requires_grad=True)
w = (0.5 + torch.rand(64)).requires_grad_(True)
y = tritonnorm.RMSNormFunction.apply(x, w, 1e-5)
y.square().sum().backward()

x_ref, w_ref = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
y_ref = x_ref * torch.rsqrt(x_ref.square().mean(-1, keepdim=True) + 1e-5) * w_ref
y_ref.square().sum().backward()
torch.testing.assert_close(y, y_ref)
torch.testing.assert_close(x.grad, x_ref.grad)
torch.testing.assert_close(w.grad, w_ref.grad)
print(f"tritonnorm {tritonnorm.__version__}: Triton forward and backward under the interpreter ok")

if importlib.util.find_spec("lab2bench") is not None:  # tritonnorm[bench]
    import lab2bench
    from lab2bench.cli import main

    with tempfile.TemporaryDirectory() as out:
        assert main(["norm", "--quick", "--impl", "tritonnorm,torch-naive,F.rms_norm",
                     "--hidden", "64", "--rows", "8", "--out", out]) == 0
        rows = lab2bench.read_records(Path(out) / "norm.jsonl", suite="norm")
        ours = [r for r in rows if r["config"]["impl"] == "tritonnorm"]
        assert ours and ours[0]["metrics"]["status"] == "ok", ours
    print(f"tritonnorm[bench] with lab2bench {lab2bench.__version__}: "
          "`lab2bench norm --quick` ok")
