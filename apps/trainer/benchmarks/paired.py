"""Training-step time of several set-ups of one model on one device, in short paired windows.

Every variant lives in one process for the whole run; ``lab2bench.timing.paired_windows``
times a window of a few back-to-back steps of each per round (in a balanced order) and
compares each with the first one within the round, which cancels the drift of a busy host
that the multi-rank scripts' 20-step windows cannot resolve.

A variant is ``NORM:DDP[:RULE][+SHARDING][@THREAD]``: NORM tritonnorm or torch
(``nn.RMSNorm``); DDP the trainer's ``--ddp`` kind none, bucketed or torch (one rank: no
collective, all the bookkeeping); RULE bucketed's bucket rule, reach (default) or at_most;
SHARDING the trainer's --sharding (default none; zero1, zero2 and fsdp need DDP none);
THREAD the thread that runs backward, caller (default) or autograd. A step is the trainer's:
bf16 autocast, forward, backward, gradient synchronisation, fused AdamW (``--compile``: every
model compiled, as the trainer compiles)::

    python apps/trainer/benchmarks/paired.py --preset small \\
        --variants torch:torch+torch tritonnorm:bucketed+zero1-allreduce
    python apps/trainer/benchmarks/paired.py --preset medium \\
        --variants torch:none@autograd torch:none tritonnorm:none tritonnorm:bucketed
    python apps/trainer/benchmarks/paired.py --preset medium --compile reduce-overhead \\
        --window 8 --rounds 10 --variants torch:none tritonnorm:none
"""

from __future__ import annotations

import argparse

import harness
import torch
import torch.distributed as dist

from lab2_trainer.config import BACKWARD_THREADS, BUCKET_RULES
from lab2_trainer.recipe.layout import SELF_REDUCING, SHARDING_KINDS


def parse_variant(p: argparse.ArgumentParser, text: str) -> dict[str, str]:
    body, _, thread = text.partition("@")
    body, _, sharding = body.partition("+")
    parts = body.split(":")
    if len(parts) not in (2, 3):
        p.error(f"variant {text!r} is not NORM:DDP[:RULE][+SHARDING][@THREAD]")
    v = dict(norm=parts[0], ddp=parts[1], rule=parts[2] if len(parts) == 3 else "reach",
             sharding=sharding or "none", thread=thread or "caller")
    for key, allowed in (("norm", ("tritonnorm", "torch")), ("ddp", ("none", "bucketed", "torch")),
                         ("rule", BUCKET_RULES), ("sharding", SHARDING_KINDS),
                         ("thread", BACKWARD_THREADS)):
        if v[key] not in allowed:
            p.error(f"{v[key]!r} in {text!r} is not one of {', '.join(allowed)}")
    if v["sharding"] in SELF_REDUCING and v["ddp"] != "none":
        p.error(f"{text}: --sharding {v['sharding']} reduces gradients itself; use DDP none")
    return v


def main(argv: list[str] | None = None) -> int:
    from lab2bench.timing import paired_windows

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="medium")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--context-length", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=10000)
    p.add_argument("--variants", nargs="+", required=True,
                   help="NORM:DDP[:RULE][+SHARDING][@THREAD] ...; the first is the baseline")
    p.add_argument("--rounds", type=int, default=14)
    p.add_argument("--window", type=int, default=5, help="timed steps per window")
    p.add_argument("--compile", metavar="MODE", default=None,
                   choices=("default", "reduce-overhead", "max-autotune"),
                   help="torch.compile every variant's model (Inductor) in this mode")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu (Gloo): a smoke test of the script, with --preset micro")
    args = p.parse_args(argv)
    setups = {text: parse_variant(p, text) for text in args.variants}
    on_gpu = args.device == "cuda"
    if on_gpu and not torch.cuda.is_available():
        p.error("no CUDA GPU (--device cpu runs a smoke test)")
    device = harness.single_rank_group(on_gpu)
    bases, steps = {}, {}
    for text, s in setups.items():
        if s["norm"] not in bases:
            config = harness.build_config(args.preset, context_length=args.context_length,
                                          vocab_size=args.vocab_size, norm=s["norm"])
            bases[s["norm"]] = (harness.build_model(config, "cpu", seed=0),
                                harness.random_batch(config, args.batch_size, device, seed=0))
        base, batch = bases[s["norm"]]
        compile_spec = None if args.compile is None else {
            "backend": "inductor", "mode": None if args.compile == "default" else args.compile}
        variant = harness.setup(harness.fresh_copy(base, device), s["sharding"], device,
                                ddp=s["ddp"], bucket_rule=s["rule"], compile=compile_spec)
        steps[text] = (lambda v=variant, b=batch, t=s["thread"]:
                       harness.step_marks(v, b, "bf16", device, t))  # marks go unread
    try:
        result = paired_windows(steps, rounds=args.rounds, window=args.window, device=device)
    finally:
        dist.destroy_process_group()
    base = args.variants[0]
    where = torch.cuda.get_device_name(device) if on_gpu else "CPU"
    print(f"{args.preset}, batch {args.batch_size} x {args.context_length}, one {where}, "
          f"{args.rounds} rounds x {args.window} steps; paired with {base} round by round")
    print(f"| variant | median ms | min ms | {base} / variant [quartiles] | variant - {base} ms |")
    print("|---|---:|---:|---:|---:|")
    for text, r in result.items():
        print(f"| {text} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | {r['ratio']:.3f} "
              f"[{r['ratio_q1']:.3f}, {r['ratio_q3']:.3f}] | {r['diff_ms']:+.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
