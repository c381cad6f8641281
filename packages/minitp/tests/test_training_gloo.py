"""Training steps of a tiny LM sharded by ``parallelize`` on Gloo ranks, against the same
LM whole in one process (float64).

The LM: vocab-parallel embedding tied to a column-parallel output layer, two blocks, the
loss by ``vocab_parallel_cross_entropy`` with some targets ignored. Three steps of SGD
with momentum and of AdamW, with and without sequence parallelism, in one spawn: every
step's loss, and after the last step every parameter (shards all-gathered) and its
gradient, match the single-process run.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from lab2_testing.dist import run_ranks
from lab2_testing.modules import load_path
from minitp import parallelize, vocab_parallel_cross_entropy

tp_models = load_path(Path(__file__).with_name("tp_models.py"), "minitp_tests_tp_models")
B, T, VOCAB = tp_models.B, tp_models.T, tp_models.VOCAB
STEPS = 3
OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
              "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    targets = torch.randint(0, VOCAB, (B, T), generator=g)
    targets[0, step] = -100  # ignored
    return ids, targets


def _train(model, loss_fn, opt_name):
    cls, kwargs = OPTIMIZERS[opt_name]
    opt = cls(model.parameters(), **kwargs)
    losses = []
    for step in range(STEPS):
        ids, targets = _batch(step)
        opt.zero_grad()
        loss = loss_fn(model(ids), targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def training_rank(rank: int, world: int) -> dict[str, float]:
    errors = {}
    for opt_name in OPTIMIZERS:
        full = tp_models.build(tp_models.TinyLM, seed=21)
        want = _train(full, lambda logits, y: F.cross_entropy(logits.flatten(0, 1),
                                                              y.flatten()), opt_name)
        for sp in (False, True):
            sharded = parallelize(tp_models.build(tp_models.TinyLM, seed=21),
                                  tp_models.lm_plan(), sequence_parallel=sp)
            assert sharded.head.weight is sharded.embed.weight  # still tied, one shard
            got = _train(sharded, vocab_parallel_cross_entropy, opt_name)
            case = f"{opt_name} sp={sp}"
            for step, (a, b) in enumerate(zip(got, want)):
                errors[f"{case} loss step {step}"] = abs(a - b) / abs(b)
            for name, err in tp_models.compare_to_full(sharded, full, "").items():
                errors[f"{case} {name}"] = err
    return errors


def test_training_steps_match_single_process(world_size):
    for rank, errors in enumerate(run_ranks(training_rank, world_size, timeout=110)):
        bad = {k: v for k, v in errors.items() if not v < tp_models.TOL}
        assert not bad, f"rank {rank}: {bad}"
        assert len(errors) > 4 * STEPS  # losses and parameters were compared
