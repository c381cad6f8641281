"""``minitp.random`` on Gloo ranks seeded alike (a tensor-parallel group):

* inside ``sharded_rng`` every rank draws masks of its own, from a stream reproducible
  from the seed; after it the default streams are in step again, one draw further on every
  rank alike (what a process draws after one ``randint``);
* ``torch.utils.checkpoint`` recomputes the same masks inside the fork (the recomputed
  forward and the gradients equal those without checkpointing, bitwise);
* ``sharded_dropout`` compiled (``fullgraph=True``: no break) keeps this rank's part of
  the mask the whole tensor draws (in one process, from the same seed), so the ranks'
  masks differ; rate 0 and evaluation return the input itself; a group of one is
  ``F.dropout`` with the default stream;
* ``check_same_rng`` passes ranks seeded alike and names those seeded otherwise;
  ``sharded_rng`` refuses to run under ``torch.compile``.
"""

from __future__ import annotations

import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lab2_testing.dist import run_ranks
from minitp.random import check_same_rng, sharded_dropout, sharded_rng

SEED, SHAPE, P = 7, (4, 12, 16), 0.5  # 12 positions: divides by 1 to 4 ranks


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


def _forked_mask() -> torch.Tensor:
    with sharded_rng():
        return F.dropout(torch.ones(SHAPE, dtype=torch.float64), P) != 0


def _block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A small computation with dropout on this rank's part in the middle."""
    h = torch.tanh(x @ w)
    return (sharded_dropout(h, P, dim=1) * h).sum(-1)


def _gradients(checkpointed: bool) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(SEED)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SHAPE, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(SHAPE[-1], SHAPE[-1], generator=g, dtype=torch.float64,
                    requires_grad=True)
    y = checkpoint(_block, x, w, use_reentrant=False) if checkpointed else _block(x, w)
    y.sum().backward()
    return y.detach(), x.grad, w.grad


def random_rank(rank: int, world: int) -> dict:
    out: dict = {}
    n = world
    # Forked masks: this rank's own, reproducible; the default stream after the fork is
    # one draw further, alike on every rank.
    torch.manual_seed(SEED)
    mask = _forked_mask()
    after = torch.rand(8)
    out["masks"] = _gather(mask.double())
    out["after"] = _gather(after)
    torch.manual_seed(SEED)
    if n > 1:
        torch.randint(0, 2**63 - 1, ())  # the fork's one draw
    else:
        F.dropout(torch.ones(SHAPE, dtype=torch.float64), P)  # one rank: no fork
    out["after one draw"] = torch.equal(after, torch.rand(8))
    torch.manual_seed(SEED)
    out["reproducible"] = torch.equal(mask, _forked_mask())
    out["kept share"] = mask.double().mean().item()

    # Activation checkpointing recomputes the forked masks.
    plain, recomputed = _gradients(False), _gradients(True)
    out["checkpoint equal"] = all(torch.equal(a, b) for a, b in zip(plain, recomputed))

    # Compiled: this rank's part of the whole tensor's mask, no graph break.
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: sharded_dropout(t, P, dim=1), backend="aot_eager",
                             fullgraph=True)
    torch.manual_seed(SEED)
    x = torch.ones(SHAPE[0], SHAPE[1] // n, SHAPE[2], dtype=torch.float64,
                   requires_grad=True)
    y = compiled(x)
    y.sum().backward()
    torch.manual_seed(SEED)
    whole = F.dropout(torch.ones(SHAPE, dtype=torch.float64), P)
    want = whole.chunk(n, 1)[rank]
    out["compiled equals part of whole"] = torch.equal(y.detach(), want)
    out["compiled gradient"] = torch.equal(x.grad, want)
    out["compiled masks"] = _gather((y.detach() != 0).double())

    # Nothing dropped at rate 0 or in evaluation: the input itself.
    t = torch.randn(SHAPE)
    out["identity"] = (sharded_dropout(t, 0.0, dim=1) is t
                       and sharded_dropout(t, P, training=False, dim=1) is t)

    # check_same_rng: alike passes; a rank seeded otherwise is named everywhere.
    torch.manual_seed(SEED)
    check_same_rng()
    torch.manual_seed(SEED + (rank == n - 1))
    try:
        check_same_rng()
        out["differ"] = None
    except RuntimeError as exc:
        out["differ"] = str(exc)

    # sharded_rng is eager-only.
    torch._dynamo.reset()
    try:
        torch.compile(lambda t: _forked_mask() * t, backend="eager")(torch.ones(SHAPE))
        out["fork under compile"] = None
    except RuntimeError as exc:
        out["fork under compile"] = str(exc)
    return out


def test_sharded_and_replicated_streams(world_size):
    results = run_ranks(random_rank, world_size, timeout=240)
    n = world_size
    for rank, got in enumerate(results):
        assert got["after one draw"], rank
        assert got["reproducible"], rank
        assert 0.3 < got["kept share"] < 0.7, got["kept share"]
        assert got["checkpoint equal"], rank
        assert got["compiled equals part of whole"] and got["compiled gradient"], rank
        assert got["identity"], rank
        assert "sharded_rng cannot run under torch.compile" in got["fork under compile"]
        # The default streams stay in step over the fork.
        assert all(torch.equal(a, got["after"][0]) for a in got["after"]), rank
        if n == 1:
            assert got["differ"] is None
            continue
        assert f"ranks [{n - 1}]" in got["differ"], got["differ"]
        for key in ("masks", "compiled masks"):
            masks = got[key]
            for i in range(n):
                for j in range(i + 1, n):
                    assert not torch.equal(masks[i], masks[j]), (key, i, j)
    if n == 1:
        # One rank: the default stream itself, as F.dropout draws it.
        torch.manual_seed(SEED)
        want = (F.dropout(torch.ones(SHAPE, dtype=torch.float64), P) != 0).double()
        assert torch.equal(results[0]["masks"][0], want)
