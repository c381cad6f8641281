"""lab2bench.ranks: the launcher of local ranks used by distributed benchmarks."""

import os

import pytest

from lab2bench.ranks import RankError, ping, spawn_ranks, threads_per_rank


def test_launcher_returns_results_and_reports_failures():
    assert spawn_ranks(ping, 2, {"offset": 1}, timeout=120) == [3.0, 3.0]
    with pytest.raises(RankError, match="rank 1 fails on purpose"):
        spawn_ranks(ping, 2, {"fail_rank": 1}, timeout=120, pg_timeout=60)


def test_launcher_rejects_bad_world_size_and_leaves_env():
    before = os.environ.get("OMP_NUM_THREADS")
    with pytest.raises(ValueError, match="world_size"):
        spawn_ranks(ping, 0, {})
    assert os.environ.get("OMP_NUM_THREADS") == before
    assert threads_per_rank(2) >= 1


def test_core_names_the_failing_rank_and_removes_its_rendezvous(tmp_path, monkeypatch):
    import tempfile

    from lab2bench.ranks import RankGroup

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(RankError) as info, \
            RankGroup(ping, 2, {"fail_rank": 0}, pg_timeout=60) as group:
        assert group.tmp is not None and os.path.isdir(group.tmp)
        group.collect(120)
    assert info.value.kind == "raised" and info.value.rank == 0
    assert "fails on purpose" in info.value.detail
    assert not list(tmp_path.iterdir())
    assert all(not p.is_alive() for p in group.procs)
