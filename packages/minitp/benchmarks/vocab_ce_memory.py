"""Peak memory of the loss over a vocabulary cut across ranks: ``vocab_parallel_cross_entropy``
on each rank's logits slice against gathering the logits (``gather_from_region``, what
``ColwiseLinear(gather_output=True)`` does) then ``F.cross_entropy``, forward and
backward, at vocabularies of 32k to 128k.

Each rank measures the peak of what torch allocates while the loss runs forward and
backward, above what it held before (its logits slice and the targets); the table gives
the largest rank's. On CUDA that is ``torch.cuda.max_memory_allocated``; the default
backend there is Gloo, so that several ranks can share one GPU (rank r uses GPU r mod the
GPUs visible). The CPU has no allocator peak to read: there the allocations and frees that
``torch.profiler`` records (``profile_memory=True``) are replayed in order. Next to each
measurement, the analytic figure, for N tokens, vocabulary V, tp ranks, logits of s bytes
an element (the vocab-parallel loss computes in at least float32, a chunk of rows at a time):

* vocab-parallel: the gradient, N·V/tp·s, and the float32 work of one chunk of rows
  (``minitp.vocab.CHUNK_BYTES``, 32 MiB, twice when s < 4: the cast and the shifted copy);
  nothing of the logits' size is kept from forward (the logits slice itself is, as
  autograd keeps it for the head anyway).
* gathered: in backward, log-softmax's output (kept from forward), its gradient and the
  gradient of the logits, N·V·s each: 3·N·V·s. The all-gather's own buffers (its input
  slice, N·V/tp·s, and its rank-major output, N·V·s) can stay allocated past forward
  when the backend releases a finished collective late (Gloo does, at times): then up to
  that much more is measured.

    python packages/minitp/benchmarks/vocab_ce_memory.py                  # CPU, 1024 tokens
    python packages/minitp/benchmarks/vocab_ce_memory.py --device cuda --ranks 4
    python packages/minitp/benchmarks/vocab_ce_memory.py --quick          # 64 tokens
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's own log lines, on stderr

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lab2bench.ranks import RankGroup  # noqa: E402
from lab2bench.report import markdown_table  # noqa: E402
from minitp import gather_from_region, vocab_parallel_cross_entropy  # noqa: E402
from minitp.vocab import CHUNK_BYTES  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MIB = 2**20


def analytic_bytes(tokens: int, vocab: int, ranks: int, itemsize: int) -> tuple[int, int]:
    """(vocab-parallel, gathered) peak bytes per rank above the logits slice."""
    local = tokens * vocab // ranks
    chunk = min(CHUNK_BYTES, 4 * local) * (2 if itemsize < 4 else 1)
    return local * itemsize + chunk, 3 * tokens * vocab * itemsize


def peak_bytes(fn, device: torch.device) -> tuple[int, object]:
    """(peak bytes torch allocated above the start while ``fn()`` ran, its result)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start, result
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    held = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        held += event.nbytes()  # negative for a free
        peak = max(peak, held)
    return peak, result


def measure_vocab(vocab: int, rank: int, world: int, spec: dict,
                  device: torch.device) -> dict:
    """Each loss's value and this rank's peak bytes at one vocabulary."""
    # Each rank draws its own slice (never the whole logits); the targets are shared.
    gen = torch.Generator(device=device).manual_seed(vocab)
    targets = torch.randint(0, vocab, (spec["tokens"],), generator=gen, device=device)
    gen.manual_seed(vocab + 1 + rank)
    local = torch.randn(spec["tokens"], vocab // world, generator=gen, device=device,
                        dtype=DTYPES[spec["dtype"]]).requires_grad_()
    losses = {"vocab-parallel": lambda: vocab_parallel_cross_entropy(local, targets),
              "gathered": lambda: F.cross_entropy(gather_from_region(local), targets)}
    row: dict = {"vocab": vocab}
    for name, loss_fn in losses.items():

        def forward_backward(loss_fn=loss_fn) -> float:
            loss = loss_fn()
            loss.backward()
            local.grad = None
            return loss.item()

        row[f"{name} peak"], row[name] = peak_bytes(forward_backward, device)
    return row


def bench_rank(rank: int, world: int, spec: dict) -> list[dict]:
    """One rank: per vocabulary, each loss's value and peak bytes (the largest rank's)."""
    device = torch.device("cuda", torch.cuda.current_device()) if spec["device"] == "cuda" \
        else torch.device("cpu")
    out = [measure_vocab(vocab, rank, world, spec, device) for vocab in spec["vocabs"]]
    on = device if dist.get_backend() == "nccl" else "cpu"
    for row in out:
        for key in [k for k in row if k.endswith("peak")]:
            t = torch.tensor([row[key]], dtype=torch.float64, device=on)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            row[key] = int(t.item())
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="tensor-parallel ranks (default 2)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--backend", default="gloo",
                   help="default gloo (ranks may share a GPU); nccl needs a GPU per rank")
    p.add_argument("--tokens", type=int, default=None,
                   help="rows of logits (B·T); default 8192 on cuda, 1024 on cpu")
    p.add_argument("--vocabs", default="32768,65536,131072", help="comma-separated")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="of the logits; default float32 on cpu, bfloat16 on cuda")
    p.add_argument("--quick", action="store_true", help="64 tokens: seconds on the CPU")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    tokens = 64 if args.quick else args.tokens or (8192 if args.device == "cuda" else 1024)
    vocabs = [int(v) for v in args.vocabs.split(",")]
    if args.ranks < 1 or any(v % args.ranks for v in vocabs):
        raise SystemExit(f"every vocabulary of {vocabs} must divide by --ranks {args.ranks}")
    spec = {"device": args.device, "dtype": dtype, "tokens": tokens, "vocabs": vocabs}
    with RankGroup(bench_rank, args.ranks, spec, device=args.device, backend=args.backend,
                   pg_timeout=1800, preload=["minitp", "torch.profiler"]) as group:
        per_rank = group.collect(1800)
    itemsize = DTYPES[dtype].itemsize
    rows = []
    for row in per_rank[0]:
        vocab = row["vocab"]
        diff = abs(row["vocab-parallel"] - row["gathered"]) / abs(row["gathered"])
        if diff > 1e-2:
            raise SystemExit(f"vocab {vocab}: the losses disagree ({row})")
        parallel, gathered = analytic_bytes(tokens, vocab, args.ranks, itemsize)
        rows.append({"vocab": vocab,
                     "vocab-parallel MiB": row["vocab-parallel peak"] / MIB,
                     "analytic": parallel / MIB,
                     "gathered MiB": row["gathered peak"] / MIB,
                     "gathered analytic": gathered / MIB,
                     "ratio": row["gathered peak"]
                     / max(row["vocab-parallel peak"], 1)})
    how = "torch.cuda.max_memory_allocated" if args.device == "cuda" \
        else "CPU, torch.profiler memory events"
    print(f"Peak memory per rank (largest rank) of the loss forward and backward, {tokens} "
          f"tokens, {dtype} logits, {args.ranks} ranks ({args.backend}); measured with "
          f"{how}; torch {torch.__version__}\n")
    print(markdown_table(rows, floatfmt=".1f", headers={
        "analytic": "(analytic)", "gathered analytic": "(analytic)",
        "ratio": "gathered / vocab-parallel"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
