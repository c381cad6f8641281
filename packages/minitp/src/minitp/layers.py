"""Column- and row-parallel linear layers, with and without sequence parallelism.

A linear layer computes ``y = x Wᵀ + b`` with ``W`` of shape ``[out, in]``. There are two
ways to cut ``W`` over the ``tp`` ranks of a group:

* **Column parallel**: cut along the output features (the rows of ``W``). Rank r holds
  ``W_r`` of shape ``[out/tp, in]`` and computes ``y_r = x W_rᵀ + b_r``, its slice of the
  output features, from the whole input ``x``.
* **Row parallel**: cut along the input features (the columns of ``W``). Rank r holds
  ``W_r`` of shape ``[out, in/tp]``, takes its slice of the input features ``x_r`` and
  computes a partial sum ``x_r W_rᵀ``; ``y`` is the sum over ranks, plus ``b`` once.

A column layer followed by a row layer (an MLP's up and down projections; attention's
q/k/v and output projections, with the heads in between) communicates only at its two
ends: the column layer's output shards are exactly the row layer's input shards, and what
runs between them (an activation, attention head by head) works shard by shard. Forward:
one all-reduce, of the row layer's output; backward: one all-reduce, of the column layer's
input gradient (the input was used by every rank's shard, so its gradient is a sum).

**Sequence parallelism.** Outside such pairs (norms, residual adds, dropout) every rank
would hold and process the same ``[B, T, d]`` tensor. Under sequence parallelism each rank
keeps its slice of the sequence instead, ``[B, T/tp, d]``: the column layer all-gathers its
input along T before the matmul, the row layer reduce-scatters its output along T. An
all-reduce *is* a reduce-scatter followed by an all-gather, so the traffic is the same,
while the activations outside the pairs shrink by ``tp``. A parameter used on the slice
(the row layer's bias here, a norm's weight elsewhere) gets only this slice's gradient;
its gradient is summed over the group in backward.

**Overlap.** In the column layer's backward the input gradient ``grad_y W`` must be summed
over the group (all-reduced; reduce-scattered under sequence parallelism), and the weight
gradient ``grad_yᵀ x`` does not need that sum. So the collective is launched
asynchronously, the weight gradient computed while it runs, and the collective waited for
last. ``overlap_grad_reduce=False`` waits at once, for measuring what the overlap saves
(``benchmarks/overlap.py``). Under sequence parallelism the gathered input is kept for the
weight gradient (``B·T·in`` per layer, rather than gathering it again in backward).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from minitp.mappings import (
    Group,
    copy_to_region,
    gather_from_region,
    group_rank,
    group_size,
    reduce_from_region,
    reduce_scatter_to_sequence,
    split_to_region,
    start_all_gather,
    start_all_reduce,
    start_reduce_scatter,
)


def shard_size(total: int, tp: int, what: str, multiple_of: int = 1) -> int:
    """``total // tp``, refusing sizes that do not cut into ``tp`` equal shards of whole
    ``multiple_of`` units (a head's ``head_dim`` features, say)."""
    if total % (tp * multiple_of):
        unit = f" of whole units of {multiple_of}" if multiple_of > 1 else ""
        raise ValueError(f"{what} = {total} does not split into {tp} equal shards{unit}")
    return total // tp


def _init_uniform(t: torch.Tensor, fan_in: int) -> None:
    """``nn.Linear``'s default: uniform in ±1/sqrt(fan_in), fan_in of the whole layer."""
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    with torch.no_grad():
        t.uniform_(-bound, bound)


def _adopt(source: torch.Tensor, piece: torch.Tensor) -> nn.Parameter:
    """A parameter holding ``piece`` of ``source`` in storage of its own (not a view that
    would keep the whole tensor alive)."""
    return nn.Parameter(piece.detach().clone(memory_format=torch.contiguous_format),
                        requires_grad=source.requires_grad)


# ------------------------------------------------------------------ column parallel
class _ColumnLinear(Function):
    """``x Wᵀ + b`` for a column shard, its input entering the region: gathered along the
    sequence under sequence parallelism, and the input gradient summed in backward,
    overlapped with the weight-gradient matmul."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, seq_dim, overlap):
        total = start_all_gather(x, seq_dim, group, "forward").wait() if sequence_parallel \
            else x
        ctx.save_for_backward(total, weight)
        ctx.group, ctx.sp, ctx.seq_dim, ctx.overlap = group, sequence_parallel, seq_dim, overlap
        ctx.has_bias = bias is not None
        return F.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        total, weight = ctx.saved_tensors
        grad_input = pending = None
        if ctx.needs_input_grad[0]:
            summed = grad.matmul(weight)  # this rank's part of the input gradient
            pending = (start_reduce_scatter(summed, ctx.seq_dim, ctx.group, "backward")
                       if ctx.sp else start_all_reduce(summed, ctx.group, "backward"))
            if not ctx.overlap:
                grad_input, pending = pending.wait(), None
        # While the collective runs: the weight and bias gradients, which do not need it.
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_weight = grad_2d.t().matmul(total.reshape(-1, total.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_2d.sum(0)
        if pending is not None:
            grad_input = pending.wait()
        return grad_input, grad_weight, grad_bias, None, None, None, None


def _column_linear(x, weight, bias, group, sequence_parallel, seq_dim, overlap):
    """:class:`_ColumnLinear` as autocast would run ``F.linear``: under autocast the input,
    weight and bias are cast to its dtype first (their casts' backward returns each
    gradient in its parameter's dtype) and the function runs with autocast off, so that its
    hand-written backward multiplies tensors of one dtype."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
        with torch.autocast(device, enabled=False):
            return _ColumnLinear.apply(x, weight, bias, group, sequence_parallel, seq_dim,
                                       overlap)
    return _ColumnLinear.apply(x, weight, bias, group, sequence_parallel, seq_dim, overlap)


class ColumnParallelLinear(nn.Module):
    """A linear layer whose output features are cut over the group: this rank holds
    ``weight`` of shape ``[out_features / tp, in_features]`` (rows ``[r·out/tp,
    (r+1)·out/tp)`` of the whole matrix) and the matching slice of ``bias``.

    Args:
        in_features, out_features: the whole layer's sizes; ``out_features`` must split
            into ``tp`` equal shards (of whole ``multiple_of`` units).
        group: the tensor-parallel process group (None: the default group).
        bias: whether the layer has a bias.
        gather_output: all-gather the output features, so every rank gets the whole
            ``[..., out_features]``; otherwise the output is this rank's
            ``[..., out_features / tp]``.
        sequence_parallel: the input is this rank's slice of the sequence along
            ``seq_dim``; it is all-gathered before the matmul, and the input gradient is
            reduce-scattered back.
        seq_dim: the sequence dimension of the input (1 for ``[B, T, d]``).
        overlap_grad_reduce: overlap the input-gradient collective with the weight-gradient
            matmul in backward (False: wait for it at once).
        input_in_region: the caller has already brought the input into the region (copied,
            or gathered along the sequence), as :class:`minitp.SharedInput` does once for
            several projections: this layer then communicates nothing on its input.
        multiple_of: each shard must hold whole units of this many features.
        device, dtype: of the parameters. Initialised as ``nn.Linear`` initialises the
            whole layer; use :meth:`from_linear` to take an existing layer's values.
    """

    def __init__(self, in_features: int, out_features: int, group: Group = None, *,
                 bias: bool = True, gather_output: bool = False,
                 sequence_parallel: bool = False, seq_dim: int = 1,
                 overlap_grad_reduce: bool = True, input_in_region: bool = False,
                 multiple_of: int = 1, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.group, self.tp, self.rank = group, group_size(group), group_rank(group)
        self.in_features, self.out_features = in_features, out_features
        self.local_out = shard_size(out_features, self.tp, "out_features", multiple_of)
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.seq_dim, self.overlap_grad_reduce = seq_dim, overlap_grad_reduce
        self.input_in_region = input_in_region
        self.weight = nn.Parameter(torch.empty(self.local_out, in_features, device=device,
                                               dtype=dtype))
        self.bias = nn.Parameter(torch.empty(self.local_out, device=device, dtype=dtype)) \
            if bias else None
        if self.weight.device.type != "meta":
            _init_uniform(self.weight, in_features)
            if self.bias is not None:
                _init_uniform(self.bias, in_features)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Group = None,
                    **kwargs) -> ColumnParallelLinear:
        """This rank's shard of ``linear`` (its values, dtype and device); ``kwargs`` as in
        the constructor."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear needs an nn.Linear, got {type(linear).__name__}")
        layer = cls(linear.in_features, linear.out_features, group,
                    bias=linear.bias is not None, device="meta", **kwargs)
        rows = slice(layer.rank * layer.local_out, (layer.rank + 1) * layer.local_out)
        layer.weight = _adopt(linear.weight, linear.weight[rows])
        if linear.bias is not None:
            layer.bias = _adopt(linear.bias, linear.bias[rows])
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_in_region or self.tp == 1:
            y = F.linear(x, self.weight, self.bias)
        else:
            y = _column_linear(x, self.weight, self.bias, self.group, self.sequence_parallel,
                               self.seq_dim, self.overlap_grad_reduce)
        return gather_from_region(y, self.group, -1) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.local_out} here, rank {self.rank} of {self.tp}), "
                f"bias={self.bias is not None}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


# ------------------------------------------------------------------ row parallel
class RowParallelLinear(nn.Module):
    """A linear layer whose input features are cut over the group: this rank holds
    ``weight`` of shape ``[out_features, in_features / tp]`` (columns ``[r·in/tp,
    (r+1)·in/tp)``) and the whole ``bias``, added once, after the reduction.

    Args:
        in_features, out_features: the whole layer's sizes; ``in_features`` must split
            into ``tp`` equal shards (of whole ``multiple_of`` units).
        group: the tensor-parallel process group (None: the default group).
        bias: whether the layer has a bias.
        input_is_parallel: the input is already this rank's ``[..., in_features / tp]``
            (a column layer's output); otherwise it is the whole input, and this rank
            keeps its slice.
        sequence_parallel: reduce-scatter the output along ``seq_dim`` (each rank gets its
            slice of the sequence) instead of all-reducing it.
        seq_dim: the sequence dimension of the output (1 for ``[B, T, d]``).
        multiple_of: each shard must hold whole units of this many features.
        device, dtype: of the parameters; see :class:`ColumnParallelLinear`.
    """

    def __init__(self, in_features: int, out_features: int, group: Group = None, *,
                 bias: bool = True, input_is_parallel: bool = True,
                 sequence_parallel: bool = False, seq_dim: int = 1, multiple_of: int = 1,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.group, self.tp, self.rank = group, group_size(group), group_rank(group)
        self.in_features, self.out_features = in_features, out_features
        self.local_in = shard_size(in_features, self.tp, "in_features", multiple_of)
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.seq_dim = seq_dim
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in, device=device,
                                               dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) \
            if bias else None
        if self.weight.device.type != "meta":
            _init_uniform(self.weight, in_features)
            if self.bias is not None:
                _init_uniform(self.bias, in_features)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Group = None,
                    **kwargs) -> RowParallelLinear:
        """This rank's shard of ``linear`` (its values, dtype and device); ``kwargs`` as in
        the constructor."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear needs an nn.Linear, got {type(linear).__name__}")
        layer = cls(linear.in_features, linear.out_features, group,
                    bias=linear.bias is not None, device="meta", **kwargs)
        cols = slice(layer.rank * layer.local_in, (layer.rank + 1) * layer.local_in)
        layer.weight = _adopt(linear.weight, linear.weight[:, cols])
        if linear.bias is not None:
            layer.bias = _adopt(linear.bias, linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = split_to_region(x, self.group, -1)
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(partial, self.group, self.seq_dim)
        else:
            y = reduce_from_region(partial, self.group)
        if self.bias is None:
            return y
        # Under sequence parallelism the bias meets only this rank's slice: copy_to_region
        # (identity forward) sums its gradient over the group in backward.
        return y + (copy_to_region(self.bias, self.group) if self.sequence_parallel
                    else self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.local_in} here, rank {self.rank} "
                f"of {self.tp}), out_features={self.out_features}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")
