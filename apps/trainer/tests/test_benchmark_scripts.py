"""The benchmark scripts still run against the trainer's code (plumbing only, no timing)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from lab2bench import read_records

SCRIPTS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_paired_runs_every_kind_of_variant_on_the_cpu():
    variants = ["torch:none", "tritonnorm:bucketed:at_most@autograd", "torch:torch+torch",
                "tritonnorm:bucketed+zero1-allreduce", "tritonnorm:none+zero2"]
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "paired.py"), "--device", "cpu", "--preset", "micro",
         "--batch-size", "2", "--context-length", "16", "--vocab-size", "64", "--rounds", "2",
         "--window", "1", "--variants", *variants],
        capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "ms" not in line]
    assert [row.split("|")[1].strip() for row in rows] == variants


def test_paired_refuses_a_bad_variant():
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "paired.py"), "--device", "cpu", "--variants",
         "tritonnorm:ring"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "'ring'" in done.stderr


def test_mfu_plan_check_measures_and_predicts_on_the_cpu(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "mfu.py"), "--device", "cpu", "--plan-check", "--out",
         str(tmp_path), "--warmup", "1", "--steps", "1", "--vocab-size", "64", "--configs",
         "medium:2x16:eager:none", "medium:2x16:eager:full", "medium:2x16:eager:selective"],
        capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    records = read_records(tmp_path / "mfu.jsonl")
    assert [r["config"]["config"].split(":")[-1] for r in records] == ["none", "full",
                                                                       "selective"]
    assert all(r["metrics"]["predicted_peak_GiB"] > 0 and r["metrics"]["step_ms"] > 0
               for r in records)
    assert "| medium:2x16:eager:full |" in (tmp_path / "mfu.md").read_text()


def test_mfu_refuses_a_bad_configuration():
    done = subprocess.run([sys.executable, str(SCRIPTS / "mfu.py"), "--device", "cpu",
                           "--configs", "medium:8"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "bad configuration 'medium:8'" in done.stderr


def test_compile_time_measures_a_scope_in_a_fresh_process(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "compile_time.py"), "--device", "cpu", "--scopes",
         "blocks", "--backend", "eager", "--rounds", "1", "--warmup", "0", "--steps", "1",
         "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (record,) = read_records(tmp_path / "compile_time.jsonl")
    figures = record["metrics"]
    assert figures["graphs"] == 3  # embedding, head, and one for every block
    assert figures["time_to_first_step_s"] > figures["first_step_s"] > 0
    assert "| blocks | 1 |" in (tmp_path / "compile_time.md").read_text()


def test_compile_time_refuses_a_bad_scope():
    done = subprocess.run([sys.executable, str(SCRIPTS / "compile_time.py"), "--device", "cpu",
                           "--scopes", "layers"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "unknown scope(s) layers" in done.stderr


def test_goodput_runs_the_command_and_reads_its_stalls(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "goodput.py"), "--device", "cpu", "--steps", "4",
         "--out", str(tmp_path)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    (record,) = read_records(tmp_path / "goodput.jsonl")
    assert record["variant"] == "async" and record["saves"] == 2
    assert 0 < record["goodput"] < 1 and len(record["stalls_s"]) == 2


def test_fp8_throughput_interleaves_the_precisions_on_the_cpu(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "fp8_throughput.py"), "--device", "cpu", "--no-compile",
         "--rounds", "2", "--window", "1", "--warmup", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    records = read_records(tmp_path / "fp8_throughput.jsonl")
    assert [r["config"]["variant"] for r in records] == ["bf16", "tensorwise", "rowwise",
                                                          "bf16#2"]
    ratios = {r["config"]["variant"]: r["metrics"] for r in records}
    assert ratios["bf16"]["ratio"] == 1 and ratios["bf16"]["predicted_ratio"] == 1
    # The planner counts the blocks' products at the float8 rate: faster, at most 2x.
    assert 1 < ratios["tensorwise"]["predicted_ratio"] < 2
    assert "A/A control bf16#2" in done.stdout


def test_rope_table_interleaves_the_table_and_the_computed_angles_on_the_cpu(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "rope_table.py"), "--device", "cpu", "--rounds", "2",
         "--window", "1", "--warmup", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    records = read_records(tmp_path / "rope_table.jsonl")
    assert [r["config"]["variant"] for r in records] == ["table", "computed", "table#2"]
    assert records[0]["metrics"]["ratio"] == 1 and "A/A control table#2" in done.stdout


def test_fp8_throughput_refuses_an_unknown_variant():
    done = subprocess.run([sys.executable, str(SCRIPTS / "fp8_throughput.py"), "--device",
                           "cpu", "--variants", "bf16", "fp4"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "unknown variant(s) fp4" in done.stderr
