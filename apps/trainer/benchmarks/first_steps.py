"""The first steps of each preset with the trainer's defaults: the loss and the gradient
norm of every step, beside the bound the defaults keep (``ln(vocab) + 0.5`` after step 1).

Each preset's model is built and initialised by the trainer (``TransformerLM``), its
learning rate, warm-up and decay come from ``lab2_trainer.recipe.defaults`` exactly as a run that
gives no ``--lr`` gets them, and every step is the trainer's :func:`train_step` on batches
of the default corpus. Eager, one process, nothing compiled: compilation does not change
the arithmetic, and a probe of 40 steps would spend most of its time compiling.

    python apps/trainer/benchmarks/first_steps.py --presets small,medium,large,xl --steps 40
    python apps/trainer/benchmarks/first_steps.py --quick      # reduced width on the CPU

``--width`` rebuilds each preset at another width (heads and feed-forward scaled with it,
depth kept): the CPU test of the same bound (tests/test_first_steps.py) runs every preset's
depth at width 64.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from lab2_trainer.config import PRESETS, TrainSettings, model_config
from lab2_trainer.data.batches import BatchSampler
from lab2_trainer.data.corpus import load_corpus
from lab2_trainer.models.transformer import TransformerLM
from lab2_trainer.parallel.optimizers import MuonSettings, muon_ns_dtype
from lab2_trainer.parallel.parallelize import parallelize
from lab2_trainer.recipe.defaults import preset_run
from lab2_trainer.recipe.schedule import WarmupCosine
from lab2_trainer.training.step import set_lr, train_step


def reduced(preset: str, width: int | None, context_length: int | None) -> dict[str, Any]:
    """The preset's model fields, at ``width`` (heads of 16 dimensions, feed-forward 4x)
    and ``context_length`` where given; depth is kept."""
    fields: dict[str, Any] = {}
    if width is not None:
        fields.update(d_model=width, n_heads=max(1, width // 16), d_ff=4 * width)
    if context_length is not None:
        fields["context_length"] = context_length
    return fields


def first_steps(preset: str, *, steps: int, batch_size: int, device: torch.device,
                precision: str = "bf16", width: int | None = None,
                context_length: int | None = None, seed: int = 0,
                **model_fields: Any) -> dict[str, Any]:
    """Train ``preset`` for ``steps`` steps with the defaults of a run of that length
    (``model_fields`` override the model's; a test's controls).

    Returns:
        The record: the settings the defaults gave, and per step the loss, the gradient
        norm before clipping and the learning rate.
    """
    fields = {**reduced(preset, width, context_length), **model_fields}
    # the preset's own run defaults (tiny's learning rate), under what is given here
    run = {**preset_run(preset, fields), "steps": steps, "batch_size": batch_size,
           "precision": precision, "seed": seed}
    settings = TrainSettings(model=model_config(preset, norm="torch", **fields),
                             **run).fill_recipe()
    s = settings
    model = TransformerLM(s.model, seed=seed, device=device)
    parallel = parallelize(model, sharding="none", ddp="none", device=device, lr=s.lr,
                           betas=(s.beta1, s.beta2), weight_decay=s.weight_decay,
                           fused=device.type == "cuda",
                           muon=(MuonSettings(s.muon_lr, ns_dtype=muon_ns_dtype(device))
                                 if s.optimizer == "muon" else None))  # tiny's own
    schedule = WarmupCosine(s.lr, s.min_lr, s.warmup, s.steps)
    corpus = load_corpus()
    sampler = BatchSampler(corpus.train, s.model.context_length, batch_size, seed)
    losses, norms, lrs = [], [], []
    for step in range(steps):
        lrs.append(schedule(step))
        set_lr(parallel.optimizer, lrs[-1])
        loss, norm = train_step(parallel, sampler.next_local(0, 1, 1, device),
                                precision=precision, device=device, clip=s.clip)
        losses.append(loss.detach())
        norms.append(norm.detach())
    bound = math.log(s.model.vocab_size) + 0.5
    losses = [float(x) for x in torch.stack(losses).cpu()]
    norms = [float(x) for x in torch.stack(norms).float().cpu()]
    return {"preset": preset, "d_model": s.model.d_model, "n_layers": s.model.n_layers,
            "batch": f"{batch_size}x{s.model.context_length}", "precision": precision,
            "lr": s.lr, "warmup": s.warmup, "optimizer": s.optimizer, "bound": bound,
            "loss": losses,
            "grad_norm": norms, "lr_by_step": lrs,
            "max_loss_after_step_1": max(losses[1:]) if steps > 1 else None}


def row(r: dict[str, Any]) -> str:
    after = r["max_loss_after_step_1"]
    ok = "yes" if after is None or after <= r["bound"] else "**no**"
    return (f"| {r['preset']} (d {r['d_model']}, {r['n_layers']} layers) | {r['batch']} | "
            f"{r['lr']:.2e} / {r['warmup']} | {r['loss'][0]:.3f} | {after:.3f} | "
            f"{r['grad_norm'][0]:.2f} | {max(r['grad_norm']):.2f} | {r['loss'][-1]:.3f} | {ok} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="small,medium,large,xl")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--width", type=int, default=None, help="rebuild each preset at this width")
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="every preset at width 64, 8 x 64, "
                   "12 steps, fp32 on the CPU")
    p.add_argument("--out", type=Path, help="write first_steps.jsonl here")
    args = p.parse_args(argv)
    presets = args.presets.split(",")
    if args.quick:
        args.device, args.width, args.context_length = "cpu", 64, 64
        args.steps, args.batch_size, presets = 12, 8, list(PRESETS)
    unknown = [x for x in presets if x not in PRESETS]
    if unknown:
        p.error(f"unknown preset(s) {', '.join(unknown)}; choose from {', '.join(PRESETS)}")
    device = torch.device(args.device)
    precision = "bf16" if device.type == "cuda" else "fp32"
    print("| preset | batch | lr / warm-up | loss at step 1 | highest loss after step 1 | "
          "grad norm at step 1 | highest grad norm | last loss | within ln(V) + 0.5 |")
    print("|---|---|---|---:|---:|---:|---:|---:|---|")
    records = []
    for preset in presets:
        records.append(first_steps(preset, steps=args.steps, batch_size=args.batch_size,
                                   device=device, precision=precision, width=args.width,
                                   context_length=args.context_length))
        print(row(records[-1]), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "first_steps.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
