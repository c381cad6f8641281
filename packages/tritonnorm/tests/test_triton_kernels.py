"""The Triton kernels (RMSNormFunction and the custom ops) against float64 autograd.

Marked ``triton``: they run on CUDA, or on the CPU under TRITON_INTERPRET=1 (the nox
session ``triton-interpret``), where the interpreter is slow: small shapes only.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonnorm
from lab2_testing.tn_numerics import TOL, dx_scale, random_inputs, reference_grads, rel_err
from tritonnorm import RMSNormFunction, RMSNormTorchFunction, rms_norm_reference

pytestmark = pytest.mark.triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _kernels():
    """The host functions (what picks, allocates and launches the kernels)."""
    from tritonnorm import _host

    return _host


def _launcher():
    from tritonnorm import _machinery

    return _machinery


def _workspaces():
    from tritonnorm import _machinery

    return _machinery


def _launch_config():
    from tritonnorm import _tuning

    return _tuning


def _switches():
    """The launch machinery's switches."""
    from tritonnorm._machinery import SWITCHES

    return SWITCHES


def _launch():
    from tritonnorm import _launch

    return _launch


def _fwd(x, w, eps, cfg=None, **kw):
    """rms_norm_fwd with the launch configuration ``cfg`` forced (``_tuning.override``)."""
    with _launch_config().override(**(cfg or {})):
        return _kernels().rms_norm_fwd(x, w, eps, **kw)


def _bwd(dy, x, w, rstd, cfg=None, **kw):
    with _launch_config().override(**(cfg or {})):
        return _kernels().rms_norm_bwd(dy, x, w, rstd, **kw)


def _run(x, w, dy, eps=1e-5, fn=None):
    xa = x.clone().requires_grad_()
    wa = w.clone().requires_grad_()
    y = (fn or RMSNormFunction.apply)(xa, wa, eps)
    y.backward(dy)
    return y, xa.grad, wa.grad


def _check(x, w, dy, eps=1e-5, fn=None):
    dy_before = dy.clone()
    y, dx, dw = _run(x, w, dy, eps, fn)
    assert torch.equal(dy, dy_before), "backward wrote into grad_output"
    y_ref, dx_ref, dw_ref = reference_grads(x, w, dy, eps)
    assert y.dtype == x.dtype and dx.dtype == x.dtype and dw.dtype == w.dtype
    assert y.shape == x.shape and dx.shape == x.shape and dw.shape == w.shape
    assert rel_err(y, y_ref) < TOL[x.dtype]
    assert rel_err(dx, dx_ref, dx_scale(x, w, dy, eps)) < TOL[x.dtype]
    assert rel_err(dw, dw_ref) < TOL[w.dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("w32", [False, True], ids=["w_same", "w_fp32"])
@pytest.mark.parametrize("shape", [(37, 300), (2, 3, 64), (5, 1), (64, 17)], ids=str)
def test_function_matches_float64(kernel_device, dtype, w32, shape):
    x, w, dy = random_inputs(shape, dtype, torch.float32 if w32 else dtype, seed=hash(shape) % 997,
                             device=kernel_device, offset=0.2)
    _check(x, w, dy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_looped_path(kernel_device, monkeypatch, dtype):
    # Force the looped kernels (rows longer than one block) on small rows.
    x, w, dy = random_inputs((9, 100), dtype, torch.float32, seed=3, device=kernel_device)
    with _launch_config().override(max_fused_block_fwd=16, max_fused_block_bwd=16,
                                   loop_chunk=32, loop_chunk_bwd=32):
        _check(x, w, dy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(11, 100), (12, 128)], ids=str)
@pytest.mark.parametrize("cfg", [{"chunk": 32, "block_r": 4, "even": True},
                                 {"chunk": 128, "block_r": 1, "even": True},
                                 {"chunk": 64, "block_r": 2, "num_warps": 2, "even": False}],
                         ids=str)
def test_forward_reread_path(kernel_device, dtype, shape, cfg):
    # The forward that reads x twice (sum of squares, then normalise from L2), on rows that
    # take several chunks, one chunk, or end in a partial chunk (H = 100); at 12 x 128 the
    # chunks and row tiles divide the shape, so "even" runs the kernel without masks.
    x, w, _ = random_inputs(shape, dtype, torch.float32, seed=5, device=kernel_device)
    y_ref, _, _ = reference_grads(x, w, torch.ones_like(x), 1e-5)
    y, rstd = _fwd(x, w, 1e-5, cfg=cfg)
    y1, rstd1 = _fwd(x, w, 1e-5, cfg={"chunk": 0})
    assert rel_err(y, y_ref) < TOL[dtype]
    torch.testing.assert_close(rstd, rstd1, rtol=1e-5, atol=0)


def _check_kernels(x, w, dy, cfg, eps=1e-5):
    """rms_norm_fwd/bwd with a launch config, every gradient combination, vs float64."""
    y_ref, dx_ref, dw_ref = reference_grads(x, w, dy, eps)
    y, rstd = _fwd(x, w, eps, cfg=cfg)
    assert rel_err(y, y_ref) < TOL[x.dtype]
    scale = dx_scale(x, w, dy, eps)
    dx, dw = _bwd(dy, x, w, rstd, cfg=cfg)
    assert rel_err(dx, dx_ref, scale) < TOL[x.dtype]
    assert rel_err(dw, dw_ref) < TOL[w.dtype]
    dx_only, none = _bwd(dy, x, w, rstd, needs_dw=False, cfg=cfg)
    assert none is None and torch.equal(dx_only, dx)
    none, dw_only = _bwd(dy, x, w, rstd, needs_dx=False, cfg=cfg)
    assert none is None and torch.equal(dw_only, dw)
    return y, dx, dw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 9, 40], ids=lambda r: f"rows{r}")
def test_cooperative_kernels_one_slice(kernel_device, dtype, rows):
    # One slice per row: the group's exchange through memory and counters runs (a program
    # waits only for itself), so this runs on the interpreter too.
    x, w, dy = random_inputs((rows, 100), dtype, torch.float32, seed=rows, device=kernel_device)
    _check_kernels(x, w, dy, {"looped": True, "coop": True, "coop_block": 128})


@pytest.mark.parametrize("many_slices", [False, True], ids=["one_slice", "many_slices"])
def test_cooperative_backward_without_weight_gradient(kernel_device, many_slices):
    # The long-row backward accumulates the weight-gradient partials even where none is
    # wanted (no weight, a frozen one), because it runs faster so: dx must not change.
    if many_slices and kernel_device.type != "cuda":
        pytest.skip("several programs wait for each other: needs a GPU")
    x, w, dy = random_inputs((40, 1000), torch.bfloat16, torch.float32, seed=4,
                             device=kernel_device)
    cfg = {"looped": True, "coop": True, "coop_block": 256 if many_slices else 1024}
    for weight in (w, None):
        rstd = _fwd(x, weight, 1e-5, cfg=cfg)[1]
        dx_all, dw = _bwd(dy, x, weight, rstd, cfg=cfg)
        dx, no_dw = _bwd(dy, x, weight, rstd, needs_dw=False, cfg=cfg)
        assert no_dw is None and (dw is None) == (weight is None)
        assert torch.equal(dx, dx_all)


@given(rows=st.integers(1, 10_000), cols=st.integers(1, 1 << 22),
       block=st.sampled_from([16, 1024, 4096, 8192, 16384]), programs=st.integers(1, 264))
def test_cooperative_grid_fits_and_covers_every_column(rows, cols, block, programs):
    # The waits are safe only if every program of the grid can be resident at once: the
    # grid must never exceed the programs asked for (one per SM), and slices must cover
    # the row exactly once.
    layout = _launch_config().coop_layout(rows, cols, block, programs)
    if layout is None:
        assert -(-cols // block) > programs
        return
    n_slices, n_groups = layout
    assert 1 <= n_groups <= rows and n_slices * n_groups <= programs
    assert (n_slices - 1) * block < cols <= n_slices * block


@pytest.mark.skipif(not torch.cuda.is_available(), reason="several programs wait for each "
                    "other: needs a GPU (the interpreter runs programs one at a time)")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,cols,block", [(9, 100, 32), (300, 1000, 64), (3, 4096, 512),
                                             (1000, 70, 16)], ids=str)
def test_cooperative_kernels_many_slices(dtype, rows, cols, block):
    x, w, dy = random_inputs((rows, cols), dtype, torch.float32, seed=cols,
                             device=torch.device("cuda"))
    cfg = {"looped": True, "coop": True, "coop_block": block, "coop_warps": 4}
    y, dx, dw = _check_kernels(x, w, dy, cfg)
    # Each row's partials are summed in a fixed order: bitwise reproducible.
    y2, dx2, dw2 = _check_kernels(x, w, dy, cfg)
    assert torch.equal(y, y2) and torch.equal(dx, dx2) and torch.equal(dw, dw2)


@pytest.mark.parametrize("reduce", ["fold", "triton", "torch"])
def test_backward_options_agree(kernel_device, monkeypatch, reduce):
    # The tuning knobs (ROW_SUM accumulation, the dweight reduction, how the loop keeps
    # loads in flight) change only the order of float32 additions or none: every variant
    # stays within tolerance of float64.
    k = _kernels()
    monkeypatch.setattr(_switches(), "fold_dw_sum", reduce == "fold")
    with _launch_config().override(**({} if reduce == "fold" else {"dw_reduce": reduce})):
        x, w, dy = random_inputs((21, 70), torch.bfloat16, torch.bfloat16, seed=4,
                                 device=kernel_device)
        _check(x, w, dy)
        rstd = k.rms_norm_fwd(x, w, 1e-5)[1]
        _, dx_ref, dw_ref = reference_grads(x, w, dy, 1e-5)
        for cfg in ({"block_r": 4, "row_sum": True}, {"block_r": 2, "programs_per_sm": 2},
                    {"block_r": 2, "stages": 3, "row_sum": True}, {"block_r": 4, "stages": 4},
                    {"stages": 1, "prefetch": True}, {"stages": 1, "prefetch": False},
                    {"looped": True, "chunk": 32}, {"looped": True, "coop": False, "chunk": 32}):
            dx, dw = _bwd(dy, x, w, rstd, cfg=cfg)
            assert rel_err(dx, dx_ref, dx_scale(x, w, dy, 1e-5)) < TOL[torch.bfloat16]
            assert rel_err(dw, dw_ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("shape,w_dtype", [((40, 70), torch.float32), ((1000, 1000), None),
                                           ((3, 40), torch.bfloat16)], ids=str)
def test_folded_dweight_sum(kernel_device, shape, w_dtype):
    # Summing the partial weight gradients at the end of the backward kernel (by its
    # last programs to finish) gives dweight within tolerance, bitwise the same on every
    # run, and leaves the shared arrival count zeroed for the next launch.
    k = _kernels()
    if kernel_device.type == "cpu" and shape[0] * shape[1] > 30_000:
        pytest.skip("too slow for the interpreter")
    x, w, dy = random_inputs(shape, torch.bfloat16, w_dtype or torch.bfloat16, seed=shape[1],
                             device=kernel_device)
    rstd = k.rms_norm_fwd(x, w, 1e-5)[1]
    _, dx_ref, dw_ref = reference_grads(x, w, dy, 1e-5)
    cfg = {"fold": True, "block_r": 1}
    runs = [_bwd(dy, x, w, rstd, cfg=cfg) for _ in range(3)]
    runs.append(_bwd(dy, x, w, rstd, needs_dx=False, cfg=cfg))
    for _dx, dw in runs:
        assert dw.dtype == w.dtype and torch.equal(dw, runs[0][1])
        assert rel_err(dw, dw_ref) < TOL[w.dtype]
    assert rel_err(runs[0][0], dx_ref, dx_scale(x, w, dy, 1e-5)) < TOL[torch.bfloat16]
    unfolded = _bwd(dy, x, w, rstd, cfg={"fold": False, "block_r": 1})[1]
    assert rel_err(runs[0][1], unfolded) < (1e-5 if w.dtype == torch.float32 else TOL[w.dtype])
    for c in _workspaces()._COUNTERS.values():
        assert c[0].item() == 0  # the arrival count, reset by the last arrival


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_folded_sum_under_cuda_graphs():
    # Each captured launch takes counters of its own (a graph may be replayed on any
    # stream, alongside eager launches); replays give the eager result bitwise.
    k = _kernels()
    x, w, dy = random_inputs((2000, 1000), torch.bfloat16, torch.float32, seed=3,
                             device=torch.device("cuda"))
    rstd = k.rms_norm_fwd(x, w, 1e-5)[1]
    eager = _bwd(dy, x, w, rstd, cfg={"fold": True})  # makes the pool
    free = len(_workspaces()._COUNTER_POOLS[x.get_device()])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [_bwd(dy, x, w, rstd, cfg={"fold": True}) for _ in range(2)]
    assert len(_workspaces()._COUNTER_POOLS[x.get_device()]) == free - 2
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for dx, dw in outs:
            assert torch.equal(dx, eager[0]) and torch.equal(dw, eager[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="streams need a GPU")
def test_partials_buffer_shared_per_stream_only():
    # Eager backward launches on one stream share one partials buffer (they run one after
    # another); other streams and captured launches get their own. Backward passes queued
    # on two streams at once give bitwise the results they give one at a time.
    k = _kernels()
    buffer = _workspaces().partials_buffer
    dev = torch.device("cuda")
    x = torch.empty(4, 8, device=dev)
    a = buffer(x, 4, 8)
    assert buffer(x, 4, 8) is a and buffer(x, 5, 8) is not a
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        b = buffer(x, 5, 8)
        assert buffer(x, 5, 8) is b
    assert b is not buffer(x, 5, 8)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = buffer(x, 5, 8)
    assert captured is not buffer(x, 5, 8) and captured is not b
    inputs = [random_inputs((3000, 1000), torch.bfloat16, torch.bfloat16, seed=s, device=dev)
              for s in (1, 2)]
    rstds = [k.rms_norm_fwd(xi, wi, 1e-5)[1] for xi, wi, _ in inputs]
    alone = [k.rms_norm_bwd(dy, xi, wi, r) for (xi, wi, dy), r in zip(inputs, rstds)]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(dev) for _ in inputs]
    together = []
    for _ in range(3):
        for st_, (xi, wi, dy), r in zip(streams, inputs, rstds):
            st_.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(st_):
                together.append(k.rms_norm_bwd(dy, xi, wi, r))
    torch.cuda.synchronize()
    for i, got in enumerate(together):
        assert all(torch.equal(g, e) for g, e in zip(got, alone[i % 2])), i


@pytest.mark.parametrize("cfg", [None, {"chunk": 32}, {"chunk": 32, "even": True},
                                 {"looped": True, "chunk": 32}], ids=str)
def test_forward_without_rstd(kernel_device, cfg):
    # Inference (no backward to come) skips the per-row statistic: same y, bitwise.
    k = _kernels()
    x, w, _ = random_inputs((24, 96), torch.bfloat16, torch.float32, seed=13,
                            device=kernel_device)
    y, rstd = _fwd(x, w, 1e-5, cfg=cfg)
    y2, none = _fwd(x, w, 1e-5, cfg=cfg, need_rstd=False)
    assert none is None and rstd is not None and torch.equal(y, y2)
    assert k.rms_norm_fwd(x[:0], w, 1e-5, need_rstd=False)[1] is None


def test_inference_calls_skip_autograd(kernel_device, monkeypatch):
    # rms_norm under no_grad (or on inputs that need no gradient) runs the forward
    # kernel alone, asking for no rstd, and gives what the autograd path gives.
    if kernel_device.type != "cuda":
        pytest.skip("rms_norm takes the kernels on CUDA only")
    k = _kernels()
    asked = []
    real = k.rms_norm_fwd

    def spy(*args, **kwargs):
        asked.append(kwargs.get("need_rstd", True))
        return real(*args, **kwargs)

    monkeypatch.setattr(k, "rms_norm_fwd", spy)
    x, w, _ = random_inputs((24, 96), torch.float16, torch.float16, seed=14,
                            device=kernel_device)
    wg = w.clone().requires_grad_()
    y_train = tritonnorm.rms_norm(x, wg)
    with torch.no_grad():
        y_nograd = tritonnorm.rms_norm(x, wg)
    y_plain = tritonnorm.rms_norm(x, w)
    assert asked == [True, False, False]
    assert torch.equal(y_train, y_nograd) and torch.equal(y_train, y_plain)
    assert y_train.requires_grad and not y_nograd.requires_grad
    y_fn = RMSNormFunction.apply(x, w, 1e-5)  # no input needs a gradient: no rstd
    assert asked[-1] is False and torch.equal(y_fn, y_plain)


def test_folded_sum_falls_back_when_the_driver_refuses(kernel_device, monkeypatch):
    # A cooperative launch the driver refuses (grid not resident at once) is retried
    # with the partials summed by a second kernel, and that shape is remembered.
    k = _kernels()
    monkeypatch.setattr(_launcher(), "_FOLD_REFUSED", set())
    real = _launcher().launch
    refused = []

    def refusing(kernel, grid, args, consts, num_warps, cooperative=False):
        if kernel is k._k.bwd_rows_kernel and cooperative:
            refused.append(grid)
            raise RuntimeError("too many blocks in cooperative launch")
        return real(kernel, grid, args, consts, num_warps, cooperative)

    monkeypatch.setattr(_launcher(), "launch", refusing)
    monkeypatch.setattr(_launch(), "COOPERATIVE", True)
    x, w, dy = random_inputs((20, 64), torch.float32, torch.float32, seed=12,
                             device=kernel_device)
    rstd = k.rms_norm_fwd(x, w, 1e-5)[1]
    _, dx_ref, dw_ref = reference_grads(x, w, dy, 1e-5)
    with pytest.warns(RuntimeWarning, match="refused"):
        dx, dw = _bwd(dy, x, w, rstd, cfg={"fold": True})
    for _ in range(2):
        assert rel_err(dw, dw_ref) < TOL[torch.float32]
        assert rel_err(dx, dx_ref, dx_scale(x, w, dy, 1e-5)) < TOL[torch.float32]
        dx, dw = _bwd(dy, x, w, rstd, cfg={"fold": True})  # no second try
    assert len(refused) == 1 and len(_launcher()._FOLD_REFUSED) == 1


@given(n_cols=st.integers(1, 16384), n_part=st.integers(1, 600),
       max_summers=st.integers(1, 200), max_tile=st.sampled_from([64, 256, 1024, 4096]))
@settings(max_examples=300, deadline=None)
def test_fold_layout_covers_every_column(n_cols, n_part, max_summers, max_tile):
    # Summer r takes column blocks r, r + summers, ...: with at most max_summers and
    # n_part summers, and none without a block, every column is summed exactly once.
    block_p, block_c, summers = _workspaces().fold_layout(n_cols, n_part, max_summers, max_tile)
    assert 1 <= summers <= min(n_part, max_summers)
    assert (summers - 1) * block_c < n_cols
    assert block_p * block_c <= max(max_tile, 16 * 8) and block_p >= 16 and block_c >= 8
    blocks = [b for r in range(summers) for b in range(r, -(-n_cols // block_c), summers)]
    assert sorted(blocks) == list(range(-(-n_cols // block_c)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cooperative launches need a GPU")
def test_cooperative_launch_matches_ordinary_launch(monkeypatch):
    # A CUDA cooperative launch (where Triton offers it) only changes how the grid is
    # scheduled: the same kernels give bitwise the same results as an ordinary launch.
    x, w, dy = random_inputs((300, 1000), torch.bfloat16, torch.float32, seed=8,
                             device=torch.device("cuda"))
    cfg = {"looped": True, "coop": True, "coop_block": 64, "coop_warps": 4}
    results = []
    for cooperative in (False, _launch().COOPERATIVE):
        monkeypatch.setattr(_launch(), "COOPERATIVE", cooperative)
        results.append(_check_kernels(x, w, dy, cfg))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_cooperative_launch_off_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from tritonnorm._launch import _has_cooperative_launch

    assert not _has_cooperative_launch()


def test_launch_key_tracks_triton_specialisation():
    # The direct-launch cache must tell apart every case Triton compiles separately.
    base = torch.empty(64, dtype=torch.float32)
    assert _launcher()._arg_key(base) != _launcher()._arg_key(base[1:])  # 16-byte alignment
    assert _launcher()._arg_key(base) != _launcher()._arg_key(base.to(torch.bfloat16))  # dtype
    assert _launcher()._arg_key(1) != _launcher()._arg_key(17)  # == 1 is a constant to Triton
    assert _launcher()._arg_key(32) != _launcher()._arg_key(33)  # divisibility by 16
    assert _launcher()._arg_key(16) != _launcher()._arg_key(2**31 + 16)  # int32 vs int64
    assert _launcher()._arg_key(17) == _launcher()._arg_key(33)
    assert _launcher()._arg_key(True) != _launcher()._arg_key(1)


def test_direct_args_key_and_addresses():
    t = torch.empty(64, dtype=torch.float32)
    args = (t, t[1:], 1, 32, 33, True, 1e-5)
    key, direct = _launcher()._direct_args(args)
    assert key == tuple(map(_launcher()._arg_key, args))
    assert direct == [t.data_ptr(), t[1:].data_ptr(), 1, 32, 33, True, 1e-5]


def test_launchers_reject_misplaced_or_misshapen_tensors(kernel_device):
    # The direct launch hands Triton bare addresses, so the launchers check what Triton's
    # own pointer query used to catch (a tensor on another device), and grad_output's shape.
    k = _kernels()
    x, w, dy = random_inputs((4, 32), torch.float32, torch.float32, seed=2, device=kernel_device)
    with pytest.raises(ValueError, match="weight"):
        k.rms_norm_fwd(x, w.to("meta"), 1e-5)
    rstd = k.rms_norm_fwd(x, w, 1e-5)[1]
    with pytest.raises(ValueError, match="grad_output"):
        k.rms_norm_bwd(dy[:, :16], x, w, rstd)
    with pytest.raises(ValueError, match="grad_output"):
        k.rms_norm_bwd(dy.to("meta"), x, w, rstd)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the direct launch is GPU-only")
@pytest.mark.parametrize("hooked", [False, True], ids=["no_hook", "launch_hook"])
@pytest.mark.parametrize("dtype,rows,h", [(torch.bfloat16, 999, 1024), (torch.float32, 37, 300),
                                          (torch.float16, 33, 20000)], ids=str)
def test_direct_launch_matches_jit_launch(monkeypatch, dtype, rows, h, hooked):
    # Bitwise the same results through the JIT, the cached direct launch (Triton's bare
    # launcher with tensor addresses) and, with a launch hook registered, Triton's full
    # launch path; inputs at an address that is not 16-byte aligned take their own kernel.
    k = _kernels()
    if not _switches().direct_launch:
        pytest.skip("this Triton has no direct launch")
    calls = []

    def hook(metadata):
        calls.append(metadata)

    if hooked:
        if _launcher()._HOOKS is None:
            pytest.skip("this Triton has no launch hook chains")
        _launcher()._HOOKS[0].add(hook)
    try:
        x, w, dy = random_inputs((rows + 1, h), dtype, dtype, seed=rows,
                                 device=torch.device("cuda"))
        misaligned = x.view(-1)[1:rows * h + 1].view(rows, h)
        outs = []  # [jit aligned, jit misaligned, direct aligned, direct misaligned, ...]
        for direct in (False, True, True):
            monkeypatch.setattr(_switches(), "direct_launch", direct)
            for xs, dys in ((x[:rows], dy[:rows]), (misaligned, dy[1:])):
                y, rstd = k.rms_norm_fwd(xs, w, 1e-5)
                outs.append((y, *k.rms_norm_bwd(dys, xs, w, rstd)))
        assert _switches().direct_launch, "the direct launch fell back to the JIT"
    finally:
        if hooked:
            _launcher()._HOOKS[0].remove(hook)
    for i, got in enumerate(outs[2:], start=2):
        assert all(torch.equal(a, b) for a, b in zip(outs[i % 2], got)), i
    assert bool(calls) == hooked


def test_non_contiguous_inputs(kernel_device):
    x, w, dy = random_inputs((6, 4, 80), torch.float32, torch.float32, seed=5, device=kernel_device)
    xs = x[:, :, ::2]  # column stride 2
    xt = x.transpose(0, 1)[..., :40]  # leading dims not collapsible
    dys = dy.transpose(0, 1)[..., :40].contiguous().transpose(0, 1).transpose(0, 1)
    dys = dys.transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous grad_output
    _check(xs, w[:40], dy[:, :, :40])
    _check(xt, w[:40], dys)


def test_zero_rows(kernel_device):
    x = torch.randn(0, 4, 32, device=kernel_device, requires_grad=True)
    w = torch.randn(32, device=kernel_device, requires_grad=True)
    y = RMSNormFunction.apply(x, w, 1e-5)
    y.sum().backward()
    assert y.shape == x.shape and x.grad.shape == x.shape
    assert torch.equal(w.grad, torch.zeros_like(w))


def test_weight_grad_is_bitwise_deterministic(kernel_device):
    x, w, dy = random_inputs((50, 300), torch.bfloat16, torch.float32, seed=7, device=kernel_device)
    first = _run(x, w, dy)[2]
    second = _run(x, w, dy)[2]
    assert torch.equal(first, second)


def test_backward_skips_unneeded_gradients(kernel_device, monkeypatch):
    k = _kernels()
    calls = []
    real = k.rms_norm_bwd

    def spy(*args, **kwargs):
        calls.append((kwargs["needs_dx"], kwargs["needs_dw"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(k, "rms_norm_bwd", spy)
    x, w, dy = random_inputs((8, 48), torch.float32, torch.float32, seed=9, device=kernel_device)
    xa = x.clone().requires_grad_()
    RMSNormFunction.apply(xa, w, 1e-5).backward(dy)
    wa = w.clone().requires_grad_()
    RMSNormFunction.apply(x, wa, 1e-5).backward(dy)
    assert calls == [(True, False), (False, True)]
    assert xa.grad is not None and wa.grad is not None and w.grad is None and x.grad is None
    dx, dw = real(dy, x, w, k.rms_norm_fwd(x, w, 1e-5)[1], needs_dx=True, needs_dw=False)
    assert dw is None and dx is not None


def test_validation(kernel_device):
    x = torch.randn(4, 8, device=kernel_device)
    with pytest.raises(ValueError, match=r"\(9,\)"):
        RMSNormFunction.apply(x, torch.ones(9, device=kernel_device), 1e-5)
    with pytest.raises(TypeError):
        RMSNormFunction.apply(x.to(torch.int32), torch.ones(8, device=kernel_device), 1e-5)
    with pytest.raises(TypeError, match="float64"):
        RMSNormFunction.apply(x.double(), torch.ones(8, device=kernel_device), 1e-5)


@settings(max_examples=6)
@given(
    rows=st.integers(1, 40),
    h=st.integers(1, 260),
    dtype=st.sampled_from(DTYPES),
    eps=st.sampled_from([1e-6, 1e-5, 1e-2]),
    scale=st.sampled_from([1e-2, 1.0, 20.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_all_implementations_agree(rows, h, dtype, eps, scale, seed):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, w, dy = random_inputs((rows, h), dtype, torch.float32, seed=seed, device=device,
                             scale=scale, offset=0.1)
    tri = _run(x, w, dy, eps)
    ref = _run(x, w, dy, eps, fn=RMSNormTorchFunction.apply)
    scale_dx = dx_scale(x, w, dy, eps)
    # Each implementation is within tolerance of the other (both within it of float64).
    assert rel_err(tri[0], ref[0]) < 2 * TOL[dtype]
    assert rel_err(tri[1], ref[1], scale_dx) < 2 * TOL[dtype]
    assert rel_err(tri[2], ref[2]) < 2 * TOL[torch.float32]
    assert rel_err(tri[0], rms_norm_reference(x.double(), w.double(), eps)) < TOL[dtype]


def test_compiler_ops_and_compile(kernel_device):
    from tritonnorm import _library as compiler_ops

    if not compiler_ops.HAS_LIBRARY_OPS:
        pytest.skip("torch.library.custom_op needs PyTorch 2.4")
    x, w, dy = random_inputs((6, 40), torch.float32, torch.float32, seed=11, device=kernel_device)
    _check(x, w, dy, fn=lambda a, b, eps: compiler_ops.rms_norm_fwd_op(a, b, eps)[0])
    # Tracing a triton_op runs its body on fake tensors, which Triton's interpreter (the
    # CPU) cannot take: the tracing checks need CUDA.
    utils = (None if kernel_device.type == "cuda"
             else ("test_schema", "test_autograd_registration"))
    kw = {} if utils is None else {"test_utils": utils}
    torch.library.opcheck(compiler_ops.rms_norm_fwd_op, (x, w, 1e-5), **kw)
    rstd = compiler_ops.rms_norm_fwd_op(x, w, 1e-5)[1]
    torch.library.opcheck(compiler_ops.rms_norm_bwd_op, (dy, x, w, rstd, True, False), **kw)
    if kernel_device.type == "cuda":
        # fullgraph tracing through the operators and their registered autograd.
        fn = torch.compile(lambda a, b: compiler_ops.rms_norm_fwd_op(a, b, 1e-5)[0],
                           fullgraph=True, backend="aot_eager")
        _check(x, w, dy, fn=lambda a, b, eps: fn(a, b))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the module uses the kernels on CUDA")
def test_module_compile_fullgraph_cuda():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), tritonnorm.RMSNorm(64)).cuda()
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(4, 16, 64, device="cuda")
    assert rel_err(compiled(x), model(x)) < 1e-5


def test_launch_machinery_switches_off_as_a_unit(kernel_device, monkeypatch):
    # OPTIONS.launch_machinery=False: every kernel through Triton's own launch, nothing of
    # _machinery (direct launcher, plans, pooled scratch, folded sum) touched.
    from tritonnorm.ops import OPTIONS

    def untouchable(*args, **kwargs):
        raise AssertionError("the launch machinery ran")

    for name in ("launch", "replay_forward", "replay_backward", "partials_buffer",
                 "folded_backward", "record_forward", "backward_key"):
        monkeypatch.setattr(_launcher(), name, untouchable)
    x, w, dy = random_inputs((21, 70), torch.bfloat16, torch.float32, seed=6,
                             device=kernel_device)
    with OPTIONS.override(launch_machinery=False):
        _check(x, w, dy)
        _check(x, w, dy)  # a shape seen before: still no plan
        with _launch_config().override(looped=True, chunk=32):
            _check(x, w, dy)
