"""``OPTIONS``: the switches a user of tritonnorm may set, one ``Options`` instance.

Each field says which path a call takes; ``OPTIONS.override(...)`` sets some for the
duration of a ``with`` block. The kernels' launch parameters are in ``_tuning``, the
launch machinery's own switches in ``_machinery``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass


class _Switches:
    """``override(**changes)`` for a dataclass of switches: a context manager that sets
    fields and restores them on exit (an unknown name is a TypeError)."""

    _ELSEWHERE = ""

    def override(self, **changes) -> contextlib.AbstractContextManager:
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"unknown tritonnorm {type(self).__name__.lower()} field(s): "
                            f"{', '.join(sorted(unknown))}{self._ELSEWHERE}")
        return self._override(changes)

    @contextlib.contextmanager
    def _override(self, changes: dict) -> Iterator:
        saved = {name: getattr(self, name) for name in changes}
        for name, value in changes.items():
            setattr(self, name, value)
        try:
            yield self
        finally:
            for name, value in saved.items():
                setattr(self, name, value)


def _torch_below_default() -> dict:
    return {"torch.bfloat16": 0, "torch.float16": 0, "torch.float32": 1 << 23}


@dataclass
class Options(_Switches):
    """Which path a call of ``rms_norm`` or ``fused_add_rms_norm`` takes."""

    _ELSEWHERE = ("; the launch machinery's pieces are tritonnorm._machinery.SWITCHES, "
                  "launch configurations tritonnorm._tuning.override(...)")

    eager_dispatch: str = "auto"
    """An eager call on CUDA: "kernels" (the Triton kernels), "torch" (PyTorch's
    ``F.rms_norm`` with the same casting semantics) or "auto": PyTorch's where x has fewer
    elements than ``torch_below`` names for its dtype (a host-bound call), the kernels
    otherwise; without PyTorch's fused kernel (PyTorch < 2.9), the kernels always."""

    torch_below: dict = dataclasses.field(default_factory=_torch_below_default)
    """The "auto" rule's thresholds: elements of x below which a call is host-bound, by
    ``str(x.dtype)``. 0 in 16-bit dtypes (the kernels win at every measured size), 2^23 in
    float32 (set inside whole models)."""
    # Measured: docs/benchmarks/README.md, "eager dispatch".

    compiled_dispatch: str = "auto"
    """A call traced by ``torch.compile``: "kernels" (the ``torch.ops.tritonnorm``
    operators, which Inductor launches), "inductor" (the plain-PyTorch formula, which
    Inductor fuses with the element-wise work around it) or "auto": Inductor's for
    ``rms_norm`` and for a ``fused_add_rms_norm`` below ``torch_below``, our kernels for a
    larger fused add (which already does its neighbours' work in one pass)."""
    # Measured: docs/benchmarks/README.md, "compiled dispatch".

    launch_machinery: bool = True
    """Cut the eager kernels' host time (``_machinery``: recorded launch plans, a direct
    launcher, the weight-gradient sum folded into the backward kernel). False launches
    every kernel through Triton's own launch path."""

    eager_op: bool = False
    """Route eager calls through the ``torch.ops.tritonnorm`` operators, as compiled code
    does (to test or time that path without compiling)."""

    interpret_cpu: bool = False
    """Under ``TRITON_INTERPRET=1``, run the kernels on CPU tensors as on CUDA ones (to test
    whole models on a machine without a GPU); ignored otherwise."""


OPTIONS = Options()
