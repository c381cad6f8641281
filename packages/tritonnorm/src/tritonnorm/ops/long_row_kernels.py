"""Triton kernels for rows too long for one block of registers (GPU: H > 16,384 in the
backward, > 32,768 in the forward).

* Cooperative kernels: each row is split over a group of programs, each holding its slice
  in registers, so x (and dy) are read once. The one number a slice needs from the others
  (sum of squares; in the backward the dot product sum(g * dy * x_hat)) is exchanged
  through memory as flagged 64-bit words, with one row of lag and one row of prefetch.
  Every program of the grid must be resident at once (the launcher sizes the grid so).
* Two-pass ("looped") kernels, where the cooperative ones cannot run (the interpreter runs
  programs one at a time, so a wait would never end; rows longer than the GPU's SMs can
  hold): the forward reads each row twice, the backward reads x and dy twice.

Nothing is accumulated with atomics: partials are published with atomic exchanges and
summed by every reader in a fixed order, so results are bitwise reproducible.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _fwd_looped_kernel(
    X, W, Y, RSTD, n_rows, n_cols, stride_x, stride_y, eps,
    CHUNK: tl.constexpr,
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
            w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(y_row + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _bwd_slices_kernel(
    X, W, DY, RSTD, DOT_PART, DW_PART, n_rows, n_cols, stride_x, stride_dy,
    BLOCK_H: tl.constexpr, HAS_DX: tl.constexpr, HAS_DW: tl.constexpr,
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
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for row in range(q, n_rows, n_q):
        row64 = tl.cast(row, tl.int64)
        x = tl.load(X + row64 * stride_x + cols, mask=col_ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + row64 * stride_dy + cols, mask=col_ok, other=0.0).to(tl.float32)
        x_hat = x * tl.load(RSTD + row)
        if HAS_DX:
            tl.store(DOT_PART + row64 * n_slices + s, tl.sum(dy * w * x_hat, axis=0))
        if HAS_DW:
            dw_acc += dy * x_hat
    if HAS_DW:
        tl.store(DW_PART + q * n_cols + cols, dw_acc, mask=col_ok)


@triton.jit
def _bwd_dx_looped_kernel(
    X, W, DY, RSTD, DOT_PART, DX, n_rows, n_cols, n_slices, stride_x, stride_dy, stride_dx,
    BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
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
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
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
def _fwd_coop_kernel(
    X, W, Y, RSTD, SLOTS, n_rows, n_cols, n_slices, stride_x, stride_y, eps,
    BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # Cooperative forward for long rows: each row is split over the n_slices programs of a
    # group, each holding one BLOCK_H slice in registers, so x is read from memory once.
    # The programs exchange partial sums of squares through SLOTS ([rows, n_slices] words).
    # The wait is one row behind: a program publishes row i's partial, then finishes row
    # i-1 (whose partials have long arrived), so the exchange rarely stalls. Every program
    # of the grid must be resident at once (the launcher sizes the grid so).
    g, n_groups, s, cols = _group_slice(n_slices, BLOCK_H)
    col_ok = cols < n_cols
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
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
            y = x_prev.to(tl.float32) * rstd * w
            tl.store(Y + tl.cast(prev, tl.int64) * stride_y + cols, y.to(Y.dtype.element_ty),
                     mask=col_ok)
            if s == 0:
                tl.store(RSTD + prev, rstd)
        x_prev = x


@triton.jit
def _bwd_coop_kernel(
    X, W, DY, RSTD, SLOTS, DX, DW_PART, n_rows, n_cols, n_slices, stride_x,
    stride_dy, stride_dx,
    BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, HAS_DX: tl.constexpr, HAS_DW: tl.constexpr,
):
    # Cooperative backward for long rows, organised like _fwd_coop_kernel: x and dy are
    # read once and kept in registers while the group exchanges the partial dot products
    # sum(g * dy * x_hat) that dx needs; the dweight slice accumulates in registers and is
    # stored once per program into DW_PART[group] (summed over groups afterwards).
    g, n_groups, s, cols = _group_slice(n_slices, BLOCK_H)
    col_ok = cols < n_cols
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
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
            dw_acc += dy.to(tl.float32) * x_hat
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
