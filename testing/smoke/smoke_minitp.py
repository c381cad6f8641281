"""Smoke test of an installed minitp: a model sharded by ``parallelize`` on a one-rank Gloo
group gives the bare model's output, and the vocab-parallel loss is F.cross_entropy."""

import torch
import torch.nn.functional as F
from one_rank import model_and_bare_copy, one_rank_group

import minitp

with one_rank_group():
    model, bare = model_and_bare_copy()
    minitp.parallelize(model, {"0": minitp.ColwiseLinear(), "2": minitp.RowwiseLinear()})
    assert isinstance(model[0], minitp.ColumnParallelLinear)
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x), bare(x))
    logits, targets = torch.randn(5, 11), torch.randint(0, 11, (5,))
    torch.testing.assert_close(minitp.vocab_parallel_cross_entropy(logits, targets),
                               F.cross_entropy(logits, targets))
print(f"minitp {minitp.__version__}: parallelize and the vocab-parallel loss on one Gloo rank ok")
