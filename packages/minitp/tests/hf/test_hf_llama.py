"""The Hugging Face example (``examples/hf_llama.py``): a tiny ``LlamaForCausalLM`` built
from its config (nothing downloaded), sharded by ``llama_plan`` on two Gloo ranks, against
the model whole: logits, loss and gradients to 1e-5 relative (float32).

Run by ``nox -s tests-hf`` (marker ``hf``), which installs ``transformers``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from lab2_testing.dist import run_ranks  # noqa: E402
from lab2_testing.modules import load_path  # noqa: E402

pytestmark = pytest.mark.hf

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_llama.py"


def test_llama_sharded_on_two_ranks_matches_the_whole_model():
    example = load_path(EXAMPLE, "minitp_example_hf_llama")
    for rank, errors in enumerate(run_ranks(example.check, 2, timeout=300)):
        bad = {k: v for k, v in errors.items() if not v < example.TOL}
        assert not bad, f"rank {rank}: {bad}"
        assert "logits" in errors and "q_proj grad" in errors
