"""How fast a checkpoint reaches the disk: the trainer's write path (DCP's
``FileSystemWriter`` through ``sharded_checkpoint.write_parts``, then the manifest's
checksums) by writer threads and file syncing, beside the disk's own speed.

    python apps/trainer/benchmarks/checkpoint_io.py --gb 8 --threads 1,2,4,8
    python apps/trainer/benchmarks/checkpoint_io.py --gb 1 --dir /tmp/io  # a quick look

One process, no process group. The state is ``--tensors`` equal flat float32 tensors of
``--gb`` GB together, in pinned memory where CUDA is available (as the trainer's staged
copies are). Each round writes every variant once, in a rotated order, into a fresh folder
under ``--dir`` that is removed afterwards, so the variants' rounds are each other's A/A
control:

* ``raw``: the same bytes written with plain ``write`` calls and one ``fsync`` per file, one
  file per writer thread: what the disk takes, the ceiling of the rest;
* ``dcp``: ``torch.distributed.checkpoint.save`` with ``thread_count`` threads (``files``
  files) and ``sync_files`` on or off;
* ``crc_1`` and ``crc_par``: the checksums of the written files, one file after another and
  with one worker per file (``zlib.crc32`` lets go of the GIL).

Columns are seconds and GB/s (10^9 bytes); the last rows give each variant's median and
spread (max - min) over the rounds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from lab2_trainer.checkpoint.folders import file_crc
from lab2_trainer.checkpoint.parts import Part, write_parts


def make_state(gb: float, tensors: int) -> list[Part]:
    numel = int(gb * 1e9 / 4 / tensors)
    pin = torch.cuda.is_available()
    parts = []
    for i in range(tensors):
        t = torch.empty(numel, dtype=torch.float32, pin_memory=pin)
        t.uniform_()
        parts.append(Part(f"model.t{i}", (numel,), (0,), t))
    return parts


def write_raw(parts: list[Part], folder: Path, threads: int) -> float:
    """Every part's bytes into ``threads`` files, one thread each, fsync'd."""
    folder.mkdir(parents=True)

    def one(k: int) -> None:
        with open(folder / f"raw{k}.bin", "wb") as f:
            for p in parts[k::threads]:
                f.write(memoryview(p.data.numpy()).cast("B"))
            f.flush()
            os.fsync(f.fileno())

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(threads)))
    return time.perf_counter() - start


def write_dcp(parts: list[Part], folder: Path, threads: int, sync: bool) -> float:
    from torch.distributed.checkpoint import FileSystemWriter

    folder.mkdir(parents=True)
    start = time.perf_counter()
    write_parts(parts, FileSystemWriter(str(folder), thread_count=threads, sync_files=sync))
    return time.perf_counter() - start


def checksums(folder: Path, workers: int) -> float:
    names = sorted(folder.iterdir())
    start = time.perf_counter()
    with ThreadPoolExecutor(max(1, min(workers, len(names)))) as pool:
        list(pool.map(file_crc, names))
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=8.0)
    ap.add_argument("--tensors", type=int, default=192)
    ap.add_argument("--threads", default="1,4,8", help="writer threads to compare")
    ap.add_argument("--sync", default="on,off", help="sync_files settings to compare")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default="ckpt_io_bench")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    syncs = [s == "on" for s in args.sync.split(",")]
    root = Path(args.dir)
    parts = make_state(args.gb, args.tensors)
    nbytes = sum(p.data.numel() * 4 for p in parts)
    variants = [("raw", t, True) for t in threads] + [("dcp", t, s) for t in threads
                                                       for s in syncs]
    rows: dict[str, list[dict[str, float]]] = {}
    print(f"{nbytes / 1e9:.2f} GB in {len(parts)} tensors, pinned={torch.cuda.is_available()}")
    print(f"{'variant':<22}{'round':>6}{'write_s':>9}{'GB/s':>7}{'files':>6}"
          f"{'crc_1_s':>9}{'crc_par_s':>10}")
    for r in range(args.rounds):
        shift = r % len(variants)
        for kind, t, sync in variants[shift:] + variants[:shift]:
            folder = root / f"r{r}-{kind}-{t}-{int(sync)}"
            shutil.rmtree(folder, ignore_errors=True)
            seconds = (write_raw(parts, folder, t) if kind == "raw"
                       else write_dcp(parts, folder, t, sync))
            files = len(list(folder.iterdir()))
            crc_1 = checksums(folder, 1)
            crc_par = checksums(folder, files)
            shutil.rmtree(folder)
            name = f"{kind} t={t}" + ("" if kind == "raw" else f" sync={'on' if sync else 'off'}")
            row = {"write_s": seconds, "gbps": nbytes / seconds / 1e9, "files": files,
                   "crc_1_s": crc_1, "crc_par_s": crc_par}
            rows.setdefault(name, []).append(row)
            print(f"{name:<22}{r:>6}{seconds:>9.2f}{row['gbps']:>7.2f}{files:>6}"
                  f"{crc_1:>9.2f}{crc_par:>10.2f}", flush=True)
    print("\nmedian (spread) over rounds")
    for name, runs in rows.items():
        w = [x["write_s"] for x in runs]
        c = [x["crc_par_s"] for x in runs]
        print(f"{name:<22} write {statistics.median(w):7.2f} s ({max(w) - min(w):.2f})"
              f"  {nbytes / statistics.median(w) / 1e9:5.2f} GB/s"
              f"  crc_par {statistics.median(c):6.2f} s"
              f"  crc_1 {statistics.median(x['crc_1_s'] for x in runs):6.2f} s")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
