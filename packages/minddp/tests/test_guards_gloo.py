"""Construction checks, broadcast, gradient views and misuse errors, over Gloo."""

from __future__ import annotations

import pytest
import torch

from lab2_testing import ddp_testkit as kit
from lab2_testing import rank_programs as programs
from lab2_testing import run_ranks
from minddp import DDPBucketed


def test_construction_checks_views_and_misuse_errors(world_size):
    results = run_ranks(programs.guards_rank, world_size, timeout=120)
    source = kit.snapshot(kit.build_model("mlp", programs.GUARD_SEED + world_size - 1))
    for rank, got in enumerate(results):
        if world_size > 1:
            assert len(got["mismatch"]) == 3 * len(programs.MUTATIONS)
            for (mutation, wrapper), message in got["mismatch"].items():
                name, detail = programs.MUTATIONS[mutation]
                assert message is not None, f"rank {rank}: {mutation} via {wrapper} not detected"
                assert f"rank {world_size - 1}" in message and name in message, message
                assert detail in message, message
        kit.assert_matches(got["broadcast"] | {"grad_is_none": {}},
                           source | {"grad_is_none": {}}, f"broadcast rank {rank}", tol=0.0)
        assert got["views_ok"] == [True, True, True]
        flat_names = [n for names in got["bucket_names"] for n in names]
        assert sorted(flat_names) == sorted(
            ["layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias", "unused"]
        )  # frozen_scale is left out
        assert got["bucket_counts"]["bucketed_tiny"] == 5
        assert 2 <= got["bucket_counts"]["bucketed_few"] <= 4
        assert got["bucket_counts"]["bucketed_one"] == 1
        stats = got["stats"]
        assert stats.launched_in_backward + stats.launched_in_finish == len(got["bucket_names"])
        assert 0.0 <= stats.wait_seconds <= stats.finish_seconds
        for wrapper, messages in got["errors"].items():
            assert len(messages) == 2, (wrapper, messages)
            assert wrapper in messages[0] and wrapper in messages[1]
            assert "finish_gradient_synchronization" in messages[0]
            assert "after its" in messages[1]


def test_a_given_gradient_order_launches_as_the_learned_one(world_size):
    # What makes a resumed run bitwise the same: the order learned in the first step,
    # saved and set on a fresh wrapper, gives the same buckets and the same gradients.
    for rank, got in enumerate(run_ranks(programs.gradient_order_rank, world_size,
                                         timeout=120)):
        for wrapper, res in got.items():
            assert res["before"] is None
            assert sorted(res["order"]) == list(range(len(res["order"])))
            assert res["same"] == [True] * 4, (rank, wrapper, res["same"])
            assert len(res["errors"]) == 2, (rank, wrapper, res["errors"])
            assert "permutation" in res["errors"][0]
            assert "finish_gradient_synchronization" in res["errors"][1]


def test_finish_inside_no_sync_raises_and_the_step_still_averages(world_size):
    # Nothing is averaged inside no_sync, so a finish call there is refused by name; the
    # refused call changes nothing: the step then finishes as if it had not been made.
    results = run_ranks(programs.finish_in_no_sync_rank, world_size, timeout=120)
    model = kit.build_model("mlp", programs.GUARD_SEED)
    (x, y), = kit.make_batches("mlp", programs.GUARD_SEED, 1, 2 * world_size)
    (kit.summed_loss("mlp", model(x), y) / world_size).backward()  # the ranks' average
    reference = {n: p.grad for n, p in model.named_parameters()}
    for rank, got in enumerate(results):
        for wrapper, res in got.items():
            message = res["message"]
            assert message is not None, f"rank {rank}: {wrapper} finished inside no_sync"
            assert wrapper in message and "no_sync()" in message, message
            for name, want in reference.items():
                grad = res["grads"][name]
                assert (grad is None) == (want is None), (rank, wrapper, name)
                if want is not None:
                    err = float((grad - want).norm() / want.norm().clamp_min(1e-30))
                    assert err < 1e-12, f"{wrapper} rank {rank}: {name} off by {err:.2e}"


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf")])
def test_bucket_size_must_be_positive(bad):
    with pytest.raises(ValueError, match="bucket_size_mb"):
        DDPBucketed(torch.nn.Linear(2, 2), bad)


def test_a_peer_that_leaves_raises_instead_of_hanging(world_size):
    if world_size == 1:
        pytest.skip("needs a peer")
    results = run_ranks(programs.dead_peer_rank, world_size, timeout=60, pg_timeout=10)
    assert results[-1] == {"left": True}
    for rank, got in enumerate(results[:-1]):
        assert got["error"] is not None, f"rank {rank} finished without its peer"
        assert got["seconds"] < 30


def test_fresh_gradients_move_into_the_buckets_when_each_fills(world_size):
    # No second copy of a gradient stays alive: inside no_sync each hook moves its
    # gradient into the bucket at once; in a synchronized backward, a bucket's fresh
    # gradients are moved in by the time its last member's hook has run.
    results = run_ranks(programs.gradient_home_rank, world_size, timeout=120)
    for rank, got in enumerate(results):
        assert got["after_no_sync"] == [], (rank, got)
        assert got["full_buckets"] and all(names == [] for names in got["full_buckets"]), got
        assert got["after_finish"] == [], (rank, got)
