"""tritonnorm test setup: where the Triton kernels can run.

The numerics helpers (float64 references, tolerances) are ``lab2_testing.tn_numerics``.
"""

from __future__ import annotations

import os

import pytest
import torch

# The interpreter only takes effect when TRITON_INTERPRET=1 is set before Triton is first
# imported; the nox session `triton-interpret` sets it in the environment.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CAN_RUN_TRITON = torch.cuda.is_available() or INTERPRET


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs CUDA or TRITON_INTERPRET=1 (set before importing triton)")
    for item in items:
        if "triton" in item.keywords and not CAN_RUN_TRITON:
            item.add_marker(skip)


@pytest.fixture
def kernel_device() -> torch.device:
    """Where the Triton kernels run: the GPU when there is one, else the interpreter's CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _kernels_on_every_eager_call(request):
    """Tests of the kernels (marker ``triton``) run them on every eager CUDA call: the
    eager dispatch would send small calls to ``F.rms_norm`` (a test that means to reach
    that path forces it itself)."""
    if "triton" not in request.keywords:
        yield
        return
    from tritonnorm.ops import OPTIONS

    with OPTIONS.override(eager_dispatch="kernels"):
        yield
