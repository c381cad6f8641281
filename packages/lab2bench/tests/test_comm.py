"""The all-reduce sweep's arithmetic, argument checks and skips (no ranks spawned)."""

from __future__ import annotations

import pytest

from lab2bench.comm import allreduce_sweep, bus_bandwidth, format_size, parse_size


def test_bus_bandwidth():
    assert bus_bandwidth(10.0, 2) == pytest.approx(10.0)
    assert bus_bandwidth(10.0, 4) == pytest.approx(15.0)
    assert bus_bandwidth(10.0, 1) == 0.0


@pytest.mark.parametrize("text,value", [("512KB", 512 * 1024), ("1mb", 1 << 20),
                                        ("1GiB", 1 << 30), ("4096", 4096), ("0.5K", 512)])
def test_parse_and_format_size(text, value):
    assert parse_size(text) == value
    assert parse_size(format_size(value)) == value


@pytest.mark.parametrize("bad", ["", "abc", "-1MB", "0"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_infeasible_cells_are_skipped_with_a_note():
    # nccl on the CPU is never possible: skipped without spawning anything.
    rows = allreduce_sweep(backends=("nccl",), devices=("cpu",), sizes_bytes=(1024,),
                           world_sizes=(2,), timeout=5)
    assert rows[0]["status"] == "skipped" and "CUDA" in rows[0]["note"]


@pytest.mark.parametrize("kwargs,match", [
    ({"backends": ("mpi",)}, "backend"),
    ({"devices": ("tpu",)}, "device"),
    ({"sizes_bytes": (0,)}, "sizes"),
    ({"world_sizes": (0,)}, "world_sizes"),
    ({"repeats": 0}, "repeats"),
    ({"on_error": "ignore"}, "on_error"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        allreduce_sweep(**kwargs)


@pytest.mark.timeout(120)
def test_count_collectives_leaves_process_group_methods_working(tmp_path):
    """After ``count_collectives`` a collective that calls ``ProcessGroup.allreduce`` on the
    group (as ``dist.all_reduce`` does) still works, and is no longer counted."""
    import torch
    import torch.distributed as dist

    from lab2bench.comm import count_collectives

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0,
                            world_size=1)
    try:
        t = torch.ones(3)
        with count_collectives() as counter:
            dist.all_reduce(t)
        assert len(counter.calls) == 1
        dist.all_reduce(t, async_op=True).wait()
        dist.group.WORLD.allreduce([t]).wait()
        assert len(counter.calls) == 1 and t.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()
