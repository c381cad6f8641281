"""tritonnorm's Triton kernels: all of them, and nothing else (the host side that picks and
launches them is ``tritonnorm.ops``).

Rows that fit one block of registers (the "rows" kernels):

* The forward reads a tile of BLOCK_R rows once (or, where it measured faster, twice, the
  second read from L2) and writes y and one float32 rstd per row; with a residual it adds
  it first and writes the sum too.
* The backward is a persistent grid (a few programs per SM) whose programs walk over row
  tiles, with the next tiles' loads in flight, write dx and keep a float32 partial weight
  gradient in registers, stored once per program into a [n_programs, H] buffer.
* The partials are summed over programs in a fixed order: by the backward's last programs
  to finish, in the same launch (``_sum_partials_tail``), or by ``sum_partials_kernel``.

Rows too long for one block (GPU: H > 16,384 in the backward, > 32,768 in the forward):

* Cooperative kernels: each row is split over a group of programs, each holding its slice
  in registers, so x (and dy) are read once. The one number a slice needs from the others
  (sum of squares; in the backward the dot product sum(g * dy * x_hat)) is exchanged
  through memory as flagged 64-bit words, with one row of lag and one row of prefetch.
  Every program of the grid must be resident at once (the launcher sizes the grid so).
* Two-pass ("looped") kernels, where the cooperative ones cannot run (the interpreter runs
  programs one at a time, so a wait would never end; rows longer than the GPU's SMs can
  hold): the forward reads each row twice, the backward reads x and dy twice.

Every kernel takes three mode constexprs last: HAS_W (a weight, or a gain of 1), OFFSET
(added to the weight in float32: 1.0 for Gemma's ``1 + weight``) and LLAMA (x_hat rounded
to x's dtype before the gain multiplies it, as Hugging Face's LlamaRMSNorm does; the
weight gradient then sums dy times that rounded x_hat). The offset leaves the weight
gradient unchanged (d(offset + w)/dw = 1), so it stays exact.

Nothing is accumulated with atomics (they only count arrivals or publish partials, which
every reader sums in a fixed order), so two runs give bitwise the same results.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _gain(W, cols, col_ok, HAS_W: tl.constexpr, OFFSET: tl.constexpr):
    # The float32 gain g of each column: offset + weight (the offset added in float32, as
    # Gemma's ``1 + weight.float()``), or 1 without a weight (0 in masked-off columns).
    if HAS_W:
        g = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) + OFFSET
    else:
        g = col_ok.to(tl.float32)
    return g


@triton.jit
def _normed(x_hat, dtype, LLAMA: tl.constexpr):
    # x_hat as the gain multiplies it: rounded to the input's dtype first in "llama" mode
    # (Hugging Face's ``weight * x_hat.to(input_dtype)``), as it is (float32) otherwise.
    if LLAMA:
        x_hat = x_hat.to(dtype).to(tl.float32)
    return x_hat


@triton.jit
def fwd_rows_kernel(
    X, R, W, Y, S, RSTD, n_rows, n_cols, stride_x, stride_r, stride_y, eps,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, STORE_RSTD: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_W: tl.constexpr, OFFSET: tl.constexpr, LLAMA: tl.constexpr,
):
    # One tile of BLOCK_R whole rows per program: one read of x, one write of y (and of
    # rstd, unless no backward will need it). HAS_RES: x + residual first (one read of
    # each), rounded to S's dtype and written to S (stride_y), then normalised as read
    # back from S would be, so the backward can start from S alone.
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_H)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(R + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(S.dtype.element_ty)
        tl.store(S + rows64[:, None] * stride_y + cols[None, :], x, mask=mask)
    x = x.to(tl.float32)
    g = _gain(W, cols, col_ok, HAS_W, OFFSET)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    y = _normed(x * rstd[:, None], X.dtype.element_ty, LLAMA) * g[None, :]
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    if STORE_RSTD:
        tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _nanosleep(ns: tl.constexpr):
    # Pause this warp for about ``ns`` nanoseconds (PTX nanosleep, sm_70 and later).
    return tl.inline_asm_elementwise(f"nanosleep.u32 {ns}; mov.u32 $0, 0;", "=r", [],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _sum_partials_tail(PART, OUT, COUNTER, gen, n_part, n_cols, n_red,
                       BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, SPIN_NS: tl.constexpr):
    # The end of a persistent kernel whose n_part programs have each stored one float32
    # row of PART: the last n_red programs to get here sum PART's columns into OUT (the
    # others just exit), which saves a second launch. COUNTER holds two int32: an arrival
    # count, zero on entry and reset by the last arrival, and a generation that the last
    # arrival bumps to release the other summers; ``gen`` is the generation each program
    # read when it started (nothing changes it before every program has arrived).
    #
    # Waiting is safe: the launch is cooperative (every program resident at once). Even
    # without that, a summer waits only for programs that arrive after it, all of which
    # are summers too, and n_red is at most the number of SMs, so while any is yet to
    # start, fewer than n_red waiters hold SMs and it finds a place.
    # Ordering: the CTA barrier puts every thread's stores of the partial before the one
    # thread's release (the arrival); the last arrival acquires them all and releases
    # them again with the generation, which the other summers acquire; their loads then
    # bypass L1 (.cg).
    tl.debug_barrier()
    ticket = tl.atomic_add(COUNTER, 1, sem="acq_rel", scope="gpu")
    r = ticket - (n_part - n_red)
    if r >= 0:
        if ticket == n_part - 1:
            tl.atomic_xchg(COUNTER, 0, sem="relaxed", scope="gpu")
            tl.atomic_add(COUNTER + 1, 1, sem="release", scope="gpu")
        else:
            while tl.atomic_add(COUNTER + 1, 0, sem="acquire", scope="gpu") == gen:
                if SPIN_NS > 0:  # poll gently: the programs still running need the L2
                    _nanosleep(SPIN_NS)
        tl.debug_barrier()
        # Summer r owns column blocks r, r + n_red, ...; each column adds the partials in
        # the same order every time (bitwise reproducible).
        for c0 in range(r * BLOCK_C, n_cols, n_red * BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            col_ok = cols < n_cols
            acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
            for p0 in range(0, n_part, BLOCK_P):
                p = p0 + tl.arange(0, BLOCK_P)
                acc += tl.load(PART + p.to(tl.int64)[:, None] * n_cols + cols[None, :],
                               mask=(p < n_part)[:, None] & col_ok[None, :], other=0.0,
                               cache_modifier=".cg")
            tl.store(OUT + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=col_ok)


@triton.jit
def bwd_rows_kernel(
    X, W, DY, RSTD, DX, DW_PART, DS, DR, DW, COUNTER, n_rows, n_cols, stride_x, stride_dy,
    stride_dx, stride_ds, n_red,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, HAS_DX: tl.constexpr, HAS_DW: tl.constexpr,
    PREFETCH: tl.constexpr, ROW_SUM: tl.constexpr, STAGES: tl.constexpr,
    HAS_DS: tl.constexpr, HAS_DR: tl.constexpr,
    FOLD: tl.constexpr, RED_P: tl.constexpr, RED_C: tl.constexpr, SPIN_NS: tl.constexpr,
    HAS_W: tl.constexpr, OFFSET: tl.constexpr, LLAMA: tl.constexpr,
):
    # HAS_DS (the fused residual add's backward): x is the sum s = x + residual, and the
    # gradient reaching s directly (DS) is added to dx; HAS_DR also writes that same
    # gradient in the residual's dtype to DR (stride_dx).
    # Persistent grid: program pid walks over row tiles pid, pid + P, ...; writes dx per
    # tile and keeps its share of dweight in float32 registers until the end. A program
    # needs loads in flight while it works on a tile, in one of two ways:
    # * STAGES > 1: Triton's loop pipeliner copies the next STAGES - 1 tiles' x, dy and
    #   rstd into shared memory asynchronously (cp.async), so the registers hold only the
    #   tile being worked on. Best for 16-bit rows, whose tiles are small: one tile in
    #   flight is too few bytes to cover the memory latency.
    # * PREFETCH (with STAGES = 1): the next tile is loaded into registers before the
    #   current one is worked on (software pipelining by hand), one tile in flight.
    # With neither (very long rows, where two tiles would not fit in registers) each tile
    # is loaded when its turn comes.
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    if FOLD:
        gen = tl.load(COUNTER + 1, volatile=True)  # see _sum_partials_tail
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < n_cols
    w = _gain(W, cols, col_ok, HAS_W, OFFSET)
    # ROW_SUM folds each tile's rows into a [BLOCK_H] accumulator (fewer registers, so
    # taller tiles fit); otherwise the accumulator keeps the tile's shape (no reduction
    # across threads inside the loop).
    if ROW_SUM:
        dw_acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    else:
        dw_acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    n_tiles = tl.cdiv(n_rows, BLOCK_R)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    mask = (rows < n_rows)[:, None] & col_ok[None, :] & PREFETCH
    rows64 = rows.to(tl.int64)
    x_next = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    dy_next = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
    for tile in tl.range(pid, n_tiles, n_prog, num_stages=STAGES):
        rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        if PREFETCH:
            x = x_next.to(tl.float32)
            dy = dy_next.to(tl.float32)
            # Prefetch the next tile (fully masked past the end: no memory traffic).
            nrows = rows + n_prog * BLOCK_R
            nmask = (nrows < n_rows)[:, None] & col_ok[None, :]
            nrows64 = nrows.to(tl.int64)
            x_next = tl.load(X + nrows64[:, None] * stride_x + cols[None, :], mask=nmask,
                             other=0.0)
            dy_next = tl.load(DY + nrows64[:, None] * stride_dy + cols[None, :], mask=nmask,
                              other=0.0)
        else:
            x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask,
                        other=0.0).to(tl.float32)
            dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask,
                         other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        x_hat = x * rstd[:, None]
        if HAS_DX:
            w_dy = dy * w[None, :]
            c = tl.sum(w_dy * x_hat, axis=1) / n_cols
            dx = (w_dy - x_hat * c[:, None]) * rstd[:, None]
            if HAS_DS:
                dx += tl.load(DS + rows64[:, None] * stride_ds + cols[None, :], mask=mask,
                              other=0.0).to(tl.float32)
            tl.store(DX + rows64[:, None] * stride_dx + cols[None, :],
                     dx.to(DX.dtype.element_ty), mask=mask)
            if HAS_DR:
                tl.store(DR + rows64[:, None] * stride_dx + cols[None, :],
                         dx.to(DR.dtype.element_ty), mask=mask)
        if HAS_DW:
            x_w = _normed(x_hat, X.dtype.element_ty, LLAMA)  # what the weight multiplied
            if ROW_SUM:
                dw_acc += tl.sum(dy * x_w, axis=0)
            else:
                dw_acc += dy * x_w
    if HAS_DW:
        if ROW_SUM:
            tl.store(DW_PART + pid * n_cols + cols, dw_acc, mask=col_ok)
        else:
            tl.store(DW_PART + pid * n_cols + cols, tl.sum(dw_acc, axis=0), mask=col_ok)
        # FOLD: the last programs to finish sum the partials into DW here (else a second
        # kernel does, sum_partials_kernel).
        if FOLD:
            _sum_partials_tail(DW_PART, DW, COUNTER, gen, n_prog, n_cols, n_red, RED_P,
                               RED_C, SPIN_NS)


@triton.jit
def fwd_rows_reread_kernel(
    X, W, Y, RSTD, n_rows, n_cols, stride_x, stride_y, eps,
    BLOCK_R: tl.constexpr, CHUNK: tl.constexpr, EVEN: tl.constexpr, STORE_RSTD: tl.constexpr,
    HAS_W: tl.constexpr, OFFSET: tl.constexpr, LLAMA: tl.constexpr,
):
    # As fwd_rows_kernel, but x is read twice, CHUNK columns at a time: once for the sum
    # of squares, marked to stay in L2 (evict_last), then again (from L2, evict_first) to
    # normalise. A program holds one chunk in registers instead of its whole tile, so more
    # programs fit on an SM and more loads are in flight; where that outweighs the second
    # read (served by L2, not HBM) it is faster. torch.compile's forward works this way.
    # EVEN (CHUNK divides H and BLOCK_R the rows) drops the masks (see _FWD_MASK_FREE).
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    acc = tl.zeros([BLOCK_R, CHUNK], dtype=tl.float32)
    for start in range(0, n_cols, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        x_ptr = X + rows64[:, None] * stride_x + cols[None, :]
        if EVEN:
            x = tl.load(x_ptr, eviction_policy="evict_last")
        else:
            x = tl.load(x_ptr, mask=row_ok[:, None] & (cols < n_cols)[None, :], other=0.0,
                        eviction_policy="evict_last")
        x = x.to(tl.float32)
        acc += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=1) / n_cols + eps)
    if STORE_RSTD:
        tl.store(RSTD + rows, rstd, mask=row_ok)
    for start in range(0, n_cols, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        x_ptr = X + rows64[:, None] * stride_x + cols[None, :]
        y_ptr = Y + rows64[:, None] * stride_y + cols[None, :]
        if EVEN:
            x = tl.load(x_ptr, eviction_policy="evict_first")
            if HAS_W:
                g = tl.load(W + cols, eviction_policy="evict_last").to(tl.float32) + OFFSET
            else:
                g = tl.full([CHUNK], 1.0, tl.float32)
            y = _normed(x.to(tl.float32) * rstd[:, None], X.dtype.element_ty, LLAMA)
            tl.store(y_ptr, (y * g[None, :]).to(Y.dtype.element_ty))
        else:
            col_ok = cols < n_cols
            mask = row_ok[:, None] & col_ok[None, :]
            x = tl.load(x_ptr, mask=mask, other=0.0, eviction_policy="evict_first")
            if HAS_W:
                g = tl.load(W + cols, mask=col_ok, other=0.0,
                            eviction_policy="evict_last").to(tl.float32) + OFFSET
            else:
                g = col_ok.to(tl.float32)
            y = _normed(x.to(tl.float32) * rstd[:, None], X.dtype.element_ty, LLAMA)
            y = y * g[None, :]
            tl.store(y_ptr, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def sum_partials_kernel(
    PART, OUT, n_part, n_cols, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # dweight = column sum of the [n_part, H] float32 partials, in a fixed order (the same
    # shape always adds the same numbers in the same order: bitwise reproducible), cast
    # once to the weight's dtype in the same launch.
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < n_cols
    acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for start in range(0, n_part, BLOCK_P):
        r = start + tl.arange(0, BLOCK_P)
        m = (r < n_part)[:, None] & col_ok[None, :]
        acc += tl.load(PART + r.to(tl.int64)[:, None] * n_cols + cols[None, :], mask=m, other=0.0)
    tl.store(OUT + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=col_ok)


@triton.jit
def fwd_looped_kernel(
    X, W, Y, RSTD, n_rows, n_cols, stride_x, stride_y, eps,
    CHUNK: tl.constexpr,
    HAS_W: tl.constexpr, OFFSET: tl.constexpr, LLAMA: tl.constexpr,
):
    # Persistent: each program takes rows pid, pid + P, ...; a row is read in chunks twice.
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    offs = tl.arange(0, CHUNK)
    n_chunks = tl.cdiv(n_cols, CHUNK)
    for row in range(pid, n_rows, n_prog):
        x_row = X + tl.cast(row, tl.int64) * stride_x
        y_row = Y + tl.cast(row, tl.int64) * stride_y
        acc = tl.zeros([CHUNK], dtype=tl.float32)
        for start in range(0, n_cols, CHUNK):
            cols = start + offs
            x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
            acc += x * x
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / n_cols + eps)
        tl.store(RSTD + row, rstd)
        # Backwards over the chunks: the last ones read are the likeliest still in L2.
        for k in range(0, n_chunks):
            cols = (n_chunks - 1 - k) * CHUNK + offs
            ok = cols < n_cols
            x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
            g = _gain(W, cols, ok, HAS_W, OFFSET)
            y = _normed(x * rstd, X.dtype.element_ty, LLAMA) * g
            tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def bwd_slices_kernel(
    X, W, DY, RSTD, DOT_PART, DW_PART, n_rows, n_cols, stride_x, stride_dy,
    BLOCK_H: tl.constexpr, HAS_DX: tl.constexpr, HAS_DW: tl.constexpr,
    HAS_W: tl.constexpr, OFFSET: tl.constexpr, LLAMA: tl.constexpr,
):
    # Looped backward, pass 1. Program (s, q) owns column slice s over rows q, q + Q, ...:
    # it writes the slice's share of each row's dot(g * dy, x_hat) for the dx pass and
    # keeps the slice of dweight in registers.
    s = tl.program_id(0)
    q = tl.program_id(1)
    n_q = tl.num_programs(1)
    n_slices = tl.num_programs(0)
    cols = s * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < n_cols
    w = _gain(W, cols, col_ok, HAS_W, OFFSET)
    dw_acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for row in range(q, n_rows, n_q):
        row64 = tl.cast(row, tl.int64)
        x = tl.load(X + row64 * stride_x + cols, mask=col_ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + row64 * stride_dy + cols, mask=col_ok, other=0.0).to(tl.float32)
        x_hat = x * tl.load(RSTD + row)
        if HAS_DX:
            tl.store(DOT_PART + row64 * n_slices + s, tl.sum(dy * w * x_hat, axis=0))
        if HAS_DW:
            dw_acc += dy * _normed(x_hat, X.dtype.element_ty, LLAMA)
    if HAS_DW:
        tl.store(DW_PART + q * n_cols + cols, dw_acc, mask=col_ok)


@triton.jit
def bwd_dx_looped_kernel(
    X, W, DY, RSTD, DOT_PART, DX, n_rows, n_cols, n_slices, stride_x, stride_dy, stride_dx,
    BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_W: tl.constexpr, OFFSET: tl.constexpr, LLAMA: tl.constexpr,
):
    # Looped backward, pass 2: program (row, s) writes one slice of one row's dx.
    row64 = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    cols = s * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < n_cols
    sl = tl.arange(0, BLOCK_S)
    # The row's full dot product, summed over slices in a fixed order.
    dot = tl.sum(tl.load(DOT_PART + row64 * n_slices + sl, mask=sl < n_slices, other=0.0), axis=0)
    c = dot / n_cols
    rstd = tl.load(RSTD + row64)
    x = tl.load(X + row64 * stride_x + cols, mask=col_ok, other=0.0).to(tl.float32)
    dy = tl.load(DY + row64 * stride_dy + cols, mask=col_ok, other=0.0).to(tl.float32)
    w = _gain(W, cols, col_ok, HAS_W, OFFSET)
    x_hat = x * rstd
    dx = (dy * w - x_hat * c) * rstd
    tl.store(DX + row64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=col_ok)


@triton.jit
def _publish_partial(SLOTS, row, s, n_slices, value):
    # Publish this program's float32 partial sum for ``row``: the value's bits with a
    # "written" flag above them, in one 64-bit word. Data and flag arrive together, so no
    # memory fence is needed (a fence would also wait for this program's loads in flight).
    word = value.to(tl.uint32, bitcast=True).to(tl.int64) | (1 << 32)
    tl.atomic_xchg(SLOTS + tl.cast(row, tl.int64) * n_slices + s, word, sem="relaxed")


@triton.jit
def _row_total(SLOTS, row, n_slices, BLOCK_S: tl.constexpr):
    # Wait until every program of the row's group has published its partial (the slots
    # start zeroed, so the flag bit tells written from not yet), then sum the partials in
    # slot order: every program of the group gets bitwise the same total.
    sl = tl.arange(0, BLOCK_S)
    ptrs = SLOTS + tl.cast(row, tl.int64) * n_slices + sl
    in_row = sl < n_slices
    words = tl.load(ptrs, mask=in_row, other=1 << 32, volatile=True)
    while tl.min(words >> 32, axis=0) == 0:
        words = tl.load(ptrs, mask=in_row, other=1 << 32, volatile=True)
    part = (words & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
    return tl.sum(tl.where(in_row, part, 0.0), axis=0)


@triton.jit
def _group_slice(n_slices, BLOCK_H: tl.constexpr):
    # Which part of the work this program of a cooperative grid owns: its group g (rows g,
    # g + n_groups, ...), the number of groups, and its slice s of every row (columns).
    pid = tl.program_id(0)
    s = pid % n_slices
    cols = s * BLOCK_H + tl.arange(0, BLOCK_H)
    return pid // n_slices, tl.num_programs(0) // n_slices, s, cols


@triton.jit
def _row_slice(PTR, row, stride, cols, n_rows, n_cols):
    # One row's slice; all masked off past the last row (a group's final iteration only
    # finishes the row before, and its prefetch reaches one row beyond).
    return tl.load(PTR + tl.cast(row, tl.int64) * stride + cols,
                   mask=cols < tl.where(row < n_rows, n_cols, 0), other=0.0)


@triton.jit
def fwd_coop_kernel(
    X, W, Y, RSTD, SLOTS, n_rows, n_cols, n_slices, stride_x, stride_y, eps,
    BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_W: tl.constexpr, OFFSET: tl.constexpr, LLAMA: tl.constexpr,
):
    # Cooperative forward for long rows: each row is split over the n_slices programs of a
    # group, each holding one BLOCK_H slice in registers, so x is read from memory once.
    # The programs exchange partial sums of squares through SLOTS ([rows, n_slices] words).
    # The wait is one row behind: a program publishes row i's partial, then finishes row
    # i-1 (whose partials have long arrived), so the exchange rarely stalls. Every program
    # of the grid must be resident at once (the launcher sizes the grid so).
    g, n_groups, s, cols = _group_slice(n_slices, BLOCK_H)
    col_ok = cols < n_cols
    w = _gain(W, cols, col_ok, HAS_W, OFFSET)
    x_prev = tl.zeros([BLOCK_H], dtype=X.dtype.element_ty)
    # The next row's slice is loaded one iteration ahead, so that a load is in flight
    # while the program reduces, waits and writes.
    x_next = _row_slice(X, g, stride_x, cols, n_rows, n_cols)
    n_iter = tl.cdiv(n_rows - g, n_groups)
    for it in range(0, n_iter + 1):
        row = g + it * n_groups
        live = row < n_rows
        x = x_next
        x_next = _row_slice(X, row + n_groups, stride_x, cols, n_rows, n_cols)
        if live:
            xf = x.to(tl.float32)
            _publish_partial(SLOTS, row, s, n_slices, tl.sum(xf * xf, axis=0))
        if it > 0:
            prev = row - n_groups
            rstd = 1.0 / tl.sqrt(_row_total(SLOTS, prev, n_slices, BLOCK_S) / n_cols + eps)
            y = _normed(x_prev.to(tl.float32) * rstd, X.dtype.element_ty, LLAMA) * w
            tl.store(Y + tl.cast(prev, tl.int64) * stride_y + cols, y.to(Y.dtype.element_ty),
                     mask=col_ok)
            if s == 0:
                tl.store(RSTD + prev, rstd)
        x_prev = x


@triton.jit
def bwd_coop_kernel(
    X, W, DY, RSTD, SLOTS, DX, DW_PART, n_rows, n_cols, n_slices, stride_x,
    stride_dy, stride_dx,
    BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, HAS_DX: tl.constexpr, HAS_DW: tl.constexpr,
    HAS_W: tl.constexpr, OFFSET: tl.constexpr, LLAMA: tl.constexpr,
):
    # Cooperative backward for long rows, organised like fwd_coop_kernel: x and dy are
    # read once and kept in registers while the group exchanges the partial dot products
    # sum(g * dy * x_hat) that dx needs; the dweight slice accumulates in registers and is
    # stored once per program into DW_PART[group] (summed over groups afterwards).
    g, n_groups, s, cols = _group_slice(n_slices, BLOCK_H)
    col_ok = cols < n_cols
    w = _gain(W, cols, col_ok, HAS_W, OFFSET)
    dw_acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    x_prev = tl.zeros([BLOCK_H], dtype=X.dtype.element_ty)
    dy_prev = tl.zeros([BLOCK_H], dtype=DY.dtype.element_ty)
    # As in the forward, the next row's slices are loaded one iteration ahead.
    x_next = _row_slice(X, g, stride_x, cols, n_rows, n_cols)
    dy_next = _row_slice(DY, g, stride_dy, cols, n_rows, n_cols)
    n_iter = tl.cdiv(n_rows - g, n_groups)
    for it in range(0, n_iter + 1):
        row = g + it * n_groups
        live = row < n_rows
        x = x_next
        dy = dy_next
        x_next = _row_slice(X, row + n_groups, stride_x, cols, n_rows, n_cols)
        dy_next = _row_slice(DY, row + n_groups, stride_dy, cols, n_rows, n_cols)
        rstd = tl.load(RSTD + tl.minimum(row, n_rows - 1))  # x_hat is 0 past the last row
        x_hat = x.to(tl.float32) * rstd
        if HAS_DW:
            dw_acc += dy.to(tl.float32) * _normed(x_hat, X.dtype.element_ty, LLAMA)
        if HAS_DX:
            if live:
                _publish_partial(SLOTS, row, s, n_slices,
                                 tl.sum(dy.to(tl.float32) * w * x_hat, axis=0))
            if it > 0:
                prev = row - n_groups
                prev64 = tl.cast(prev, tl.int64)
                c = _row_total(SLOTS, prev, n_slices, BLOCK_S) / n_cols
                rstd_p = tl.load(RSTD + prev)
                xh = x_prev.to(tl.float32) * rstd_p
                dx = (dy_prev.to(tl.float32) * w - xh * c) * rstd_p
                tl.store(DX + prev64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=col_ok)
            x_prev = x
            dy_prev = dy
    if HAS_DW:
        tl.store(DW_PART + g * n_cols + cols, dw_acc, mask=col_ok)
