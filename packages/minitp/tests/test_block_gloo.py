"""A Transformer block sharded by ``parallelize`` on Gloo ranks, against the block whole in
one process (float64), with and without sequence parallelism. One spawn checks:

* parity: output, input gradient, every parameter and gradient (shards all-gathered);
* communication, per block, matched to the formula (M = B·T·d elements): forward two
  all-reduces of M and backward two; under sequence parallelism forward two all-gathers
  and two reduce-scatters of M, backward the same, which a ring moves in as many bytes,
  plus one small all-reduce per parameter used on the sequence slice (the norms' and the
  row layers' biases). The logical collectives (``count_communication``) are matched to
  the calls torch.distributed received (lab2bench's ``count_collectives``) one for one;
* memory: each rank holds 1/tp of every sharded matrix, read from the parameters'
  storage.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lab2_testing.dist import run_ranks
from lab2_testing.modules import load_path
from lab2bench.comm import count_collectives
from minitp import count_communication, parallelize

tp_models = load_path(Path(__file__).with_name("tp_models.py"), "minitp_tests_tp_models")
B, T, D, DTYPE = tp_models.B, tp_models.T, tp_models.D, tp_models.DTYPE
#: What torch.distributed calls each logical collective (the native, not fallback, path).
_CALLED_AS = {"all_reduce": "all_reduce", "all_gather": "all_gather_into_tensor",
              "reduce_scatter": "reduce_scatter_tensor"}


def block_rank(rank: int, world: int) -> dict:
    out = {}
    for sp in (False, True):
        full = tp_models.build(tp_models.Block, seed=11)
        sharded = parallelize(tp_models.build(tp_models.Block, seed=11), tp_models.block_plan(),
                              sequence_parallel=sp)
        g = torch.Generator().manual_seed(12)
        x = torch.randn(B, T, D, generator=g, dtype=DTYPE)
        grad_y = torch.randn(B, T, D, generator=g, dtype=DTYPE)
        xr = x.clone().requires_grad_()
        yr = full(xr)
        (yr * grad_y).sum().backward()

        def local(t, sp=sp):
            return tp_models.seq_slice(t, rank, world) if sp else t

        xs = local(x).clone().requires_grad_()
        with count_communication() as logical, count_collectives() as called:
            y = sharded(xs)
            (y * local(grad_y)).sum().backward()
        errors = {"y": tp_models.rel_err(y, local(yr).detach()),
                  "dx": tp_models.rel_err(xs.grad, local(xr.grad))}
        errors.update(tp_models.compare_to_full(sharded, full, ""))

        storage = {}
        full_params = dict(full.named_parameters())
        for name, p in sharded.named_parameters():
            module = sharded.get_submodule(name.rpartition(".")[0])
            parts = 1 if tp_models.shard_dim(module, name.rpartition(".")[2]) is None else world
            storage[name] = (p.untyped_storage().nbytes(),
                             full_params[name].numel() * full_params[name].element_size(),
                             parts)
        out[sp] = {"errors": errors, "storage": storage,
                   "logical": [(r.kind, r.phase, r.shape, r.nbytes, r.ring_bytes)
                               for r in logical.records],
                   "called": list(called.calls)}
    return out


def _check_volume(records: list, sp: bool, world: int) -> None:
    m = (B, T, D)
    big = [(kind, phase) for kind, phase, shape, _, _ in records if shape == m]
    small = [(kind, phase, shape) for kind, phase, shape, _, _ in records if shape != m]
    if world == 1:
        assert records == [], records
        return
    if not sp:
        assert sorted(big) == sorted([("all_reduce", "forward")] * 2
                                     + [("all_reduce", "backward")] * 2), big
        assert small == [], small
    else:
        assert sorted(big) == sorted([("all_gather", "forward"), ("reduce_scatter", "forward")]
                                     * 2 + [("all_gather", "backward"),
                                            ("reduce_scatter", "backward")] * 2), big
        # norm1 and norm2 (weight, bias), attn.o_proj.bias, mlp.fc2.bias: d elements each.
        assert small == [("all_reduce", "backward", (D,))] * 6, small
    # What a ring sends per rank: 2·2·2(n-1)/n·M bytes either way.
    ring = sum(r[4] for r in records if r[2] == m)
    assert abs(ring - 8 * (world - 1) / world * B * T * D * 8) < 1e-6, ring


def test_block_parity_volume_and_memory(world_size):
    results = run_ranks(block_rank, world_size, timeout=90)
    for rank, by_sp in enumerate(results):
        for sp, got in by_sp.items():
            where = f"rank {rank} sequence_parallel={sp}"
            bad = {k: v for k, v in got["errors"].items() if not v < tp_models.TOL}
            assert not bad, f"{where}: {bad}"
            _check_volume(got["logical"], sp, world_size)
            # One torch.distributed call per logical collective, of the same bytes.
            logical = [(_CALLED_AS[k], nbytes) for k, _, _, nbytes, _ in got["logical"]]
            called = [(k, nbytes) for k, _, nbytes in got["called"]]
            assert logical == called, f"{where}: {logical} != {called}"
            for name, (held, whole, parts) in got["storage"].items():
                assert held * parts == whole, f"{where}: {name} holds {held} of {whole} bytes"
    # The sharded matrices really are cut: q_proj's weight is 1/tp of the whole.
    held, whole, parts = results[0][False]["storage"]["attn.q_proj.weight"]
    assert parts == world_size and held == whole // world_size
