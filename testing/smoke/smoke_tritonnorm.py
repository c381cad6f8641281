"""Smoke test of an installed tritonnorm: the Triton kernels, forward and backward, on CPU
tensors under Triton's interpreter, against the formula in plain PyTorch.

Run it as ``TRITON_INTERPRET=1 python smoke_tritonnorm.py`` in an environment with
``tritonnorm[interpret]`` installed (the interpreter needs numpy).
"""

import os
import sys

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

