"""The vocabulary cut over the group: an embedding and a cross-entropy that never hold
the whole vocabulary on one rank.

**Embedding.** Rank r holds rows ``[r·V/tp, (r+1)·V/tp)`` of the ``[V, d]`` table. It looks
up the ids that fall in its range, writes zeros for the others, and the ranks' results are
summed: each id is found on exactly one rank, so the sum is the lookup. The sum is an
all-reduce, or under sequence parallelism a reduce-scatter along the sequence, which
hands each rank its slice of the sequence at once.

**Cross-entropy.** A column-parallel output layer leaves each rank with its vocabulary
slice of the logits, ``[N, V/tp]``. Gathering ``[N, V]`` to compute the loss would undo the
saving exactly where it is largest (V is 32k-256k). Instead, per row of logits ``z``:

* ``m = max_v z_v``: a max over the local slice, then an all-reduce (max);
* ``S = Σ_v exp(z_v - m)`` and ``z_t - m``, the target's logit (found on one rank, zero
  on the others): local sums, then one all-reduce (sum) of both together;
* ``loss = log S - (z_t - m)``.

Backward is written by hand, on the local slice only: ``∂loss/∂z_v = softmax_v - [v = t]``,
softmax being ``exp(z_v - m) / S``, kept from forward. Three all-reduces of N floats in
all (two collectives), against an all-gather of N·V. Logits in half precision are
computed in float32; float64 stays float64.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from minitp.layers import shard_size
from minitp.mappings import (
    Group,
    compiling,
    group_rank,
    group_size,
    reduce_from_region,
    reduce_scatter_to_sequence,
    start_all_reduce,
)


def _check_ids(ids: torch.Tensor, vocab: int, what: str, ignore_index: int | None = None
               ) -> None:
    """Refuse ids outside ``[0, vocab)`` (but ``ignore_index``): a sharded lookup would
    otherwise give zeros silently. Costs one device synchronisation. Under compilation,
    where reading a value on the host would break the graph, the check is an assertion
    in the graph (``torch._assert_async``: a ``RuntimeError`` on the CPU, a device-side
    assertion on a GPU) that does not name the id."""
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"{what} must be integers, got {ids.dtype}")
    bad = (ids < 0) | (ids >= vocab)
    if ignore_index is not None:
        bad &= ids != ignore_index
    if compiling():
        torch._assert_async(~bad.any(), f"{what} outside [0, {vocab})")
    elif ids.numel() and bool(bad.any()):
        raise ValueError(f"{what} holds {ids[bad][0].item()}, outside [0, {vocab})")


# ------------------------------------------------------------------ embedding
class VocabParallelEmbedding(nn.Module):
    """An embedding table whose rows are cut over the group: this rank holds ``weight`` of
    shape ``[num_embeddings / tp, embedding_dim]``, rows ``[vocab_start, vocab_end)``.

    Args:
        num_embeddings: the whole vocabulary, divisible by ``tp``.
        embedding_dim: the width of each row.
        group: the tensor-parallel process group (None: the default group).
        padding_idx: as in ``nn.Embedding`` (its row gets no gradient).
        sequence_parallel: reduce-scatter the result along ``seq_dim``: each rank gets its
            slice of the sequence (the ids are the whole sequence on every rank).
        seq_dim: the sequence dimension of the output (1 for ids ``[B, T]``).
        device, dtype: of the table, initialised as ``nn.Embedding`` does (normal(0, 1));
            :meth:`from_embedding` takes an existing table's values.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Group = None, *,
                 padding_idx: int | None = None, sequence_parallel: bool = False,
                 seq_dim: int = 1, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.group, self.tp, self.rank = group, group_size(group), group_rank(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        local = shard_size(num_embeddings, self.tp, "num_embeddings")
        self.vocab_start, self.vocab_end = self.rank * local, (self.rank + 1) * local
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.padding_idx = padding_idx
        self.local_padding_idx = (padding_idx - self.vocab_start if padding_idx is not None
                                  and self.vocab_start <= padding_idx < self.vocab_end
                                  else None)
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        self.weight = nn.Parameter(torch.empty(local, embedding_dim, device=device,
                                               dtype=dtype))
        if self.weight.device.type != "meta":
            with torch.no_grad():
                self.weight.normal_()
                if self.local_padding_idx is not None:
                    self.weight[self.local_padding_idx].zero_()

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: Group = None,
                       **kwargs) -> VocabParallelEmbedding:
        """This rank's rows of ``embedding`` (values, dtype, device, padding_idx)."""
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"from_embedding needs an nn.Embedding, got "
                            f"{type(embedding).__name__}")
        unsupported = [name for name in ("max_norm", "scale_grad_by_freq", "sparse")
                       if getattr(embedding, name)]
        if unsupported:
            raise ValueError(f"VocabParallelEmbedding does not support {unsupported}")
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group,
                    padding_idx=embedding.padding_idx, device="meta", **kwargs)
        rows = slice(layer.vocab_start, layer.vocab_end)
        layer.weight = nn.Parameter(embedding.weight.detach()[rows].clone(),
                                    requires_grad=embedding.weight.requires_grad)
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        _check_ids(ids, self.num_embeddings, "token ids")
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self.local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # other ranks' rows
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.group, self.seq_dim)
        return reduce_from_region(out, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (rows [{self.vocab_start}, "
                f"{self.vocab_end}) here, rank {self.rank} of {self.tp}), "
                f"sequence_parallel={self.sequence_parallel}")


# ------------------------------------------------------------------ cross-entropy
#: Rows of logits the loss works on at a time, so that its float32 temporaries stay near
#: this many bytes whatever the batch: forward keeps nothing of the size of the logits,
#: backward writes only the gradient (``benchmarks/vocab_ce_memory.py`` measures it).
CHUNK_BYTES = 32 << 20


def _rows_per_chunk(width: int) -> int:
    return max(1, CHUNK_BYTES // max(1, 4 * width))


class _VocabParallelCrossEntropy(Function):
    """The loss from this rank's logits slice: one max all-reduce, one all-reduce of
    (Σ exp, target logit). It saves the logits (alive anyway as the head's output) and
    each row's log-sum-exp, and backward recomputes the softmax chunk by chunk, in at least
    float32, writing the gradient in the logits' dtype."""

    @staticmethod
    def forward(ctx, local_logits, targets, group, ignore_index, reduction):
        local_vocab = local_logits.shape[-1]
        start = group_rank(group) * local_vocab
        dtype = torch.float32 if local_logits.element_size() < 4 else local_logits.dtype
        z = local_logits.reshape(-1, local_vocab)
        t = targets.reshape(-1)
        ignored = t == ignore_index
        here = (t >= start) & (t < start + local_vocab) & ~ignored
        local_t = (t - start).masked_fill(~here, 0)

        # max over the whole vocabulary (exact in any dtype): local max, then the group's.
        m = z.max(dim=-1).values.to(dtype).contiguous()
        m = start_all_reduce(m, group, "forward", op=dist.ReduceOp.MAX).wait()
        sum_exp = torch.empty_like(m)
        step = _rows_per_chunk(local_vocab)
        for s in range(0, z.shape[0], step):
            rows = slice(s, s + step)
            sum_exp[rows] = (z[rows].to(dtype) - m[rows, None]).exp_().sum(dim=-1)
        target_logit = (z.gather(1, local_t.unsqueeze(1)).squeeze(1).to(dtype) - m) \
            .masked_fill(~here, 0)
        # Σ exp and the target's logit, summed over the group in one collective.
        sums = torch.stack([sum_exp, target_logit])
        sums = start_all_reduce(sums, group, "forward").wait()
        sum_exp, target_logit = sums
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)

        ctx.save_for_backward(local_logits, m + sum_exp.log(), local_t, here, ignored)
        ctx.reduction, ctx.compute_dtype = reduction, dtype
        ctx.count = (~ignored).sum()
        if reduction == "none":
            out = loss.view(targets.shape)
        elif reduction == "sum":
            out = loss.sum()
        else:  # mean over the targets not ignored (nan when there are none, as in torch)
            out = loss.sum() / ctx.count
        return out.to(local_logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        local_logits, lse, local_t, here, ignored = ctx.saved_tensors
        dtype = ctx.compute_dtype
        z = local_logits.reshape(-1, local_logits.shape[-1])
        if ctx.reduction == "none":
            scale = grad.reshape(-1).to(dtype)
        else:
            scale = grad.to(dtype).expand(z.shape[0])
            if ctx.reduction == "mean":
                scale = scale / ctx.count
        scale = scale.masked_fill(ignored, 0.0)
        hit = -(scale * here)
        # softmax - one_hot(target), times the loss's gradient, a chunk of rows at a time.
        grad_z = torch.empty_like(z)
        step = _rows_per_chunk(z.shape[1])
        for s in range(0, z.shape[0], step):
            rows = slice(s, s + step)
            g = (z[rows].to(dtype) - lse[rows, None]).exp_().mul_(scale[rows, None])
            g.scatter_add_(1, local_t[rows, None], hit[rows, None])
            grad_z[rows] = g
            del g  # before the next chunk's is made: one chunk alive at a time
        return grad_z.view(local_logits.shape), None, None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor,
                                 group: Group = None, *, ignore_index: int = -100,
                                 reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy`` of logits whose vocabulary is cut over the group, without
    gathering them.

    Args:
        local_logits: ``[..., V / tp]``, this rank's slice of the vocabulary (rank r holds
            ``[r·V/tp, (r+1)·V/tp)``: the output of a :class:`ColumnParallelLinear` without
            ``gather_output``).
        targets: ``[...]``, ids in ``[0, V)`` or ``ignore_index``; the same on every rank.
        group: the tensor-parallel process group (None: the default group).
        ignore_index: targets equal to it add nothing and are not counted in the mean.
        reduction: ``"mean"`` (over targets not ignored), ``"sum"`` or ``"none"`` (the
            shape of ``targets``).

    Returns:
        The loss, the same on every rank, in ``local_logits``'s dtype.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if local_logits.dim() < 1 or local_logits.shape[:-1] != targets.shape:
        raise ValueError(f"local_logits {tuple(local_logits.shape)} and targets "
                         f"{tuple(targets.shape)} must agree but for the last dimension")
    vocab = local_logits.shape[-1] * group_size(group)
    _check_ids(targets, vocab, "targets", ignore_index)
    return _VocabParallelCrossEntropy.apply(local_logits, targets, group, ignore_index,
                                            reduction)
