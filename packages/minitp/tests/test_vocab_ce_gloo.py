"""``vocab_parallel_cross_entropy`` on Gloo ranks against ``F.cross_entropy`` on the whole
logits (float64): the loss and the gradient of each rank's vocabulary slice.

Fixed cases cover every reduction with ignored targets (the default -100 and another
``ignore_index``) and logits large enough to overflow ``exp`` unshifted. A Hypothesis
property runs in every rank over random shapes (leading dimensions, vocabulary slice),
reductions, ignore patterns and logit scales; ``derandomize`` makes every rank draw the
same examples, so their collectives pair up.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import minitp.vocab as vocab_module
from lab2_testing.dist import run_ranks
from lab2_testing.modules import load_path
from minitp import vocab_parallel_cross_entropy

tp_models = load_path(Path(__file__).with_name("tp_models.py"), "minitp_tests_tp_models")
DTYPE, TOL = tp_models.DTYPE, tp_models.TOL


def _compare(rank, world, shape, local_vocab, reduction, ignore_index, scale, seed,
             ignore_share=0.25):
    """Errors of loss and gradient for one case; all ranks build the same full tensors."""
    g = torch.Generator().manual_seed(seed)
    vocab = local_vocab * world
    logits = scale * torch.randn(*shape, vocab, generator=g, dtype=DTYPE)
    targets = torch.randint(0, vocab, shape, generator=g)
    ignored = torch.rand(shape, generator=g) < ignore_share
    ignored.view(-1)[0] = False  # at least one target counts (else the mean is 0/0)
    targets[ignored] = ignore_index
    upstream = torch.randn(shape if reduction == "none" else (), generator=g, dtype=DTYPE)

    full = logits.clone().requires_grad_()
    want = F.cross_entropy(full.reshape(-1, vocab), targets.reshape(-1),
                           ignore_index=ignore_index, reduction=reduction)
    want = want.reshape(shape) if reduction == "none" else want
    (want * upstream).sum().backward()

    cols = slice(rank * local_vocab, (rank + 1) * local_vocab)
    local = logits[..., cols].clone().requires_grad_()
    got = vocab_parallel_cross_entropy(local, targets, ignore_index=ignore_index,
                                       reduction=reduction)
    (got * upstream).sum().backward()
    return {"loss": tp_models.rel_err(got, want.detach()),
            "grad": tp_models.rel_err(local.grad, full.grad[..., cols])}


def ce_rank(rank: int, world: int, max_examples: int) -> dict[str, float]:
    errors = {}
    for reduction in ("mean", "sum", "none"):
        for ignore_index in (-100, 5):
            for scale in (1.0, 1e3):  # exp(1e3) overflows float64 unless shifted by the max
                case = f"{reduction} ignore={ignore_index} scale={scale}"
                for k, v in _compare(rank, world, (2, 12), 12, reduction, ignore_index,
                                     scale, seed=len(errors)).items():
                    errors[f"{case} {k}"] = v

    # The loss works on a few rows at a time: cut a 7 x 12 batch into chunks of 3 rows
    # (12 float32 logits a row) and check it again.
    saved, vocab_module.CHUNK_BYTES = vocab_module.CHUNK_BYTES, 3 * 4 * 12
    try:
        for reduction in ("mean", "none"):
            for k, v in _compare(rank, world, (7,), 12, reduction, -100, 3.0,
                                 seed=99).items():
                errors[f"chunked {reduction} {k}"] = v
    finally:
        vocab_module.CHUNK_BYTES = saved

    worst = {"loss": 0.0, "grad": 0.0}

    @settings(max_examples=max_examples, derandomize=True, database=None, deadline=None)
    @given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple),
           local_vocab=st.integers(1, 6), reduction=st.sampled_from(["mean", "sum", "none"]),
           ignore_share=st.sampled_from([0.0, 0.5, 0.9]),
           scale=st.sampled_from([0.1, 3.0, 300.0]), seed=st.integers(0, 2**16))
    def prop(shape, local_vocab, reduction, ignore_share, scale, seed):
        errs = _compare(rank, world, shape, local_vocab, reduction, -100, scale, seed,
                        ignore_share)
        for k, v in errs.items():
            assert v < TOL, (shape, local_vocab, reduction, ignore_share, scale, k, v)
            worst[k] = max(worst[k], v)

    prop()
    errors.update({f"property worst {k}": v for k, v in worst.items()})
    return errors


def test_vocab_parallel_cross_entropy_matches_torch(world_size):
    examples = settings.default.max_examples
    for rank, errors in enumerate(run_ranks(ce_rank, world_size, examples, timeout=90)):
        bad = {k: v for k, v in errors.items() if not (v < TOL and math.isfinite(v))}
        assert not bad, f"rank {rank}: {bad}"
