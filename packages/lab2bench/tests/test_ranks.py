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


def test_stale_rendezvous_folders_of_dead_launchers_are_swept(tmp_path, monkeypatch):
    """A folder whose owner file names a launcher that has exited goes at the next start;
    a live launcher's, another host's and one without an owner file stay; the new folder
    names this process."""
    import json
    import socket
    import subprocess
    import sys
    import tempfile

    from lab2bench.ranks import OWNER_NAME, RankGroup, sweep_stale_rendezvous

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    kind = "lab2bench.ranks.RankGroup rendezvous"
    owners = {"lab2-train-rdzv-dead": {"kind": kind, "pid": dead.pid, "host": host},
              "lab2-rdzv-live": {"kind": kind, "pid": os.getpid(), "host": host},
              "lab2-rdzv-elsewhere": {"kind": kind, "pid": dead.pid, "host": "elsewhere"},
              "lab2-rdzv-unowned": None}
    for name, owner in owners.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "rendezvous").write_bytes(b"x")
        if owner is not None:
            (tmp_path / name / OWNER_NAME).write_text(json.dumps(owner))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with RankGroup(ping, 1, {"offset": 1}, pg_timeout=60) as group:
        assert not (tmp_path / "lab2-train-rdzv-dead").exists()
        mine = json.loads((tmp_path / os.path.basename(group.tmp) / OWNER_NAME).read_text())
        assert mine["pid"] == os.getpid() and mine["host"] == host
        assert group.collect(120) == [1.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "lab2-rdzv-elsewhere", "lab2-rdzv-live", "lab2-rdzv-unowned"]
    assert sweep_stale_rendezvous(str(tmp_path)) == []
