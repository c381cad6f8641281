"""The host side's view of the kernels: every launch names its arguments (``_launch``'s
NamedTuples), and those names must be the kernels' own, in order, so that a change to a
kernel's signature fails here instead of launching with arguments out of place. Also the
launch plans' pointer layouts and the tuning overrides."""

from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("triton")

from tritonnorm import _launch, _machinery, _tuning, kernels  # noqa: E402


def _params(kernel) -> tuple[str, ...]:
    return tuple(inspect.signature(getattr(kernel, "fn", kernel)).parameters)


def _launched_kernels() -> set[str]:
    """The kernels of ``kernels.py`` the host launches (its helpers start with ``_``)."""
    return {name for name, obj in vars(kernels).items()
            if name.endswith("_kernel") and not name.startswith("_") and hasattr(obj, "fn")}


def test_every_kernel_has_named_arguments():
    assert set(_launch.SIGNATURES) == _launched_kernels()


@pytest.mark.parametrize("name", sorted(_launch.SIGNATURES))
def test_named_arguments_are_the_kernels_signature(name):
    args, consts = _launch.SIGNATURES[name]
    assert args._fields + consts._fields == _params(getattr(kernels, name))
    assert consts._fields[-3:] == _launch.Mode._fields or name == "sum_partials_kernel"


@pytest.mark.parametrize("pointers, kernel", [
    (_machinery.FWD_ROWS_POINTERS, "fwd_rows_kernel"),
    (_machinery.FWD_REREAD_POINTERS, "fwd_rows_reread_kernel"),
    (_machinery.BWD_ROWS_POINTERS, "bwd_rows_kernel")])
def test_plan_pointers_lead_the_kernels_arguments(pointers, kernel):
    # A replay fills in these addresses first, in this order; the scalars come after.
    args = _launch.SIGNATURES[kernel][0]._fields
    assert args[:len(pointers)] == pointers
    assert all(name.isupper() for name in pointers)  # the kernels' tensor arguments
    assert not any(name.isupper() for name in args[len(pointers):])


def test_a_plan_is_named_and_refuses_misplaced_pointers():
    assert _machinery.Plan._fields == ("kernel", "compiled", "grid", "tail", "rstd_like")
    t = torch.empty(16)
    args = _launch.FwdRereadArgs(X=t, W=t, Y=t, RSTD=t, n_rows=1, n_cols=16, stride_x=16,
                                 stride_y=16, eps=1e-5)
    consts = _launch.FwdRereadConsts(1, 16, True, True, True, 0.0, False)
    cache = _machinery.LaunchCache()
    with pytest.raises(RuntimeError, match="pointer arguments"):
        cache.record("key", object(), kernels.fwd_rows_reread_kernel, (1, 1, 1), args, consts,
                     _machinery.FWD_ROWS_POINTERS)


def test_tuning_overrides_apply_once_and_restore():
    block_h, plain = _tuning.fwd_config(1000, 2)
    assert not _tuning.overridden()
    with _tuning.override(block_r=7, chunk=4096):
        assert _tuning.overridden()
        forced = _tuning.fwd_config(1000, 2)[1]
        assert forced.block_r == 7 and forced.chunk == block_h  # clamped to the block
        assert _tuning.bwd_config(1000, 2)[1].block_r == 7
        with _tuning.override(looped=True):
            assert _tuning.fwd_is_looped(16, _tuning.paths())
        assert not _tuning.fwd_is_looped(16, _tuning.paths())
    assert _tuning.fwd_config(1000, 2)[1] == plain and not _tuning.overridden()
    with pytest.raises(TypeError, match="no_such_field"), _tuning.override(no_such_field=1):
        pass


def test_options_keep_the_user_switches_only():
    from tritonnorm.ops import OPTIONS

    assert {f for f in vars(OPTIONS)} == {
        "eager_dispatch", "torch_below", "compiled_dispatch", "launch_machinery", "eager_op",
        "interpret_cpu"}
    with pytest.raises(TypeError, match="direct_launch"):
        OPTIONS.override(direct_launch=False)
