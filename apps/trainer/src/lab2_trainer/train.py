"""The training loop, run by every rank.

Per step: the learning rate from the schedule; this rank's micro-batches of the global
batch; forward and backward under autocast, inside ``no_sync`` for all micro-batches but
the last; gradient averaging; clipping of the averaged gradients (every rank holds all
of them, so a plain global norm is right even with a sharded optimizer); the optimizer
step. Each rank's loss is the mean over its equal slice, and the averaging across ranks
then gives the mean over the global batch: the same as one process on the whole batch.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lab2_trainer.checkpoint import (
    CHECKPOINT_NAME,
    FORMAT,
    VERSION,
    load_checkpoint,
    rng_state,
    save_atomic,
    set_rng_state,
)
from lab2_trainer.data import BatchSampler, check_batch_layout, load_corpus, unigram_entropy
from lab2_trainer.distributed import DistContext
from lab2_trainer.errors import UsageError
from lab2_trainer.model import TransformerLM
from lab2_trainer.parallel import (
    GradSync,
    build_optimizer,
    full_optimizer_state,
    load_full_optimizer_state,
)
from lab2_trainer.report import (
    SAMPLE_NAME,
    RunReporter,
    StepTimer,
    bytes_as_text,
    write_text_atomic,
)
from lab2_trainer.schedule import WarmupCosine, set_lr
from lab2_trainer.settings import TrainSettings

# Offset between the training and validation samplers' seeds.
VAL_SEED_OFFSET = 1_000_003
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_context(precision: str, device: torch.device):
    """Autocast for bf16/fp16 on the rank's device; nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[precision])


def all_mean(value: torch.Tensor) -> float:
    """Mean of a scalar over all ranks (the value itself without a process group)."""
    value = value.detach().float().reshape(1).clone()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value.item())


@torch.no_grad()
def evaluate(model: torch.nn.Module, sampler: BatchSampler, n_batches: int, ctx: DistContext,
             precision: str) -> float:
    """Mean validation loss over ``n_batches`` fixed global batches (the same windows at
    every evaluation, so the curve compares like with like)."""
    was_training = model.training
    model.eval()
    sampler.draws = 0
    total = torch.zeros((), device=ctx.device)
    for _ in range(n_batches):
        ((x, y),) = sampler.next_local(ctx.rank, ctx.world_size, 1, ctx.device)
        with autocast_context(precision, ctx.device):
            _, loss = model(x, y)
        total += loss.float()
    model.train(was_training)
    return all_mean(total / n_batches)


class Trainer:
    """Everything one rank holds for a run; :meth:`run` trains it to ``settings.steps``.

    Args:
        settings: the run (validated by the caller).
        ctx: this rank's place among the ranks.
    """

    def __init__(self, settings: TrainSettings, ctx: DistContext) -> None:
        self.s = settings
        self.ctx = ctx
        s = settings
        check_batch_layout(s.batch_size, ctx.world_size, s.grad_accum)
        self.corpus = load_corpus(s.data, s.vocab_size)
        ckpt = load_checkpoint(s.resume) if s.resume else None
        self.model = TransformerLM(s.model, seed=s.seed, device=ctx.device)
        if ckpt is not None:
            try:
                self.model.load_state_dict(ckpt["model"])
            except RuntimeError as exc:
                reason = str(exc).splitlines()[0]
                raise UsageError(f"checkpoint model does not fit: {reason}") from None
        forward_module = torch.compile(self.model) if s.compile else self.model
        self.sync = GradSync(self.model, forward_module, s.ddp, s.bucket_mb, ctx.device)
        # Evaluation and sampling skip the DDP wrapper: no gradients, nothing to average.
        self.eval_module = forward_module
        self.optimizer = build_optimizer(self.model, s.sharding, lr=s.lr, betas=(s.beta1, s.beta2),
                                         weight_decay=s.weight_decay)
        self.schedule = WarmupCosine(s.lr, s.min_lr, s.warmup, s.steps)
        T = s.model.context_length
        self.sampler = BatchSampler(self.corpus.train, T, s.batch_size, s.seed)
        self.val_sampler = BatchSampler(self.corpus.val, T, s.batch_size, s.seed + VAL_SEED_OFFSET)
        self.scaler = None
        if s.precision == "fp16":
            self.scaler = torch.amp.GradScaler(ctx.device.type)
        self.step = 0
        if ckpt is not None:
            self._restore(ckpt)

    def _restore(self, ckpt: dict[str, Any]) -> None:
        try:
            load_full_optimizer_state(self.optimizer, ckpt["optimizer"])
        except (ValueError, KeyError, RuntimeError) as exc:
            raise UsageError(f"checkpoint optimizer state does not fit: {exc}") from None
        self.sampler.load_state_dict(ckpt["sampler"])
        set_rng_state(ckpt["rng"], self.ctx.device)
        if self.scaler is not None and ckpt.get("scaler"):
            self.scaler.load_state_dict(ckpt["scaler"])
        self.step = int(ckpt["step"])

    def save_checkpoint(self, path: Path) -> None:
        """Consolidate the optimizer (collective) and write the checkpoint on rank 0."""
        optimizer_state = full_optimizer_state(self.optimizer, self.ctx.rank)
        if self.ctx.is_main:
            save_atomic({
                "format": FORMAT,
                "version": VERSION,
                "model_config": self.s.model.to_dict(),
                "model": self.model.state_dict(),
                "optimizer": optimizer_state,
                "schedule": self.schedule.state_dict(),
                "step": self.step,
                "settings": self.s.to_dict(),
                "sampler": self.sampler.state_dict(),
                "data": self.corpus.identity(),
                "rng": rng_state(self.ctx.device),
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "world_size": self.ctx.world_size,
            }, path)
        self.ctx.barrier()

    def train_step(self) -> tuple[float, float]:
        """One optimizer step; returns (global mean loss, gradient norm before clipping)."""
        s, ctx = self.s, self.ctx
        lr = self.schedule(self.step)
        set_lr(self.optimizer, lr)
        micro_batches = self.sampler.next_local(ctx.rank, ctx.world_size, s.grad_accum, ctx.device)
        loss_sum = torch.zeros((), device=ctx.device)
        for i, (x, y) in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with (contextlib.nullcontext() if last else self.sync.no_sync()):
                with autocast_context(s.precision, ctx.device):
                    _, loss = self.sync(x, y)
                scaled = loss / s.grad_accum
                if self.scaler is not None:
                    scaled = self.scaler.scale(scaled)
                scaled.backward()
            loss_sum += loss.detach()
        self.sync.finish()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = s.clip if s.clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return all_mean(loss_sum / s.grad_accum), float(grad_norm)

    def run(self, stop_at: int | None = None) -> dict[str, Any]:
        """Train to ``settings.steps``; on rank 0 also report, plot, sample and summarise.

        Args:
            stop_at: stop early after this step, with a checkpoint, as if interrupted there
                (the schedule still spans ``settings.steps``).

        Returns:
            The summary (on every rank; file paths and figures are rank 0's).
        """
        s, ctx = self.s, self.ctx
        out = Path(s.out)
        ckpt_path = out / CHECKPOINT_NAME
        reporter = None
        entropy = None
        if ctx.is_main:
            out.mkdir(parents=True, exist_ok=True)
            reporter = RunReporter(out, s.steps, self.step, quiet=s.quiet, log_every=s.log_every)
            entropy = unigram_entropy(self.corpus.train, self.corpus.vocab_size)
            if not s.quiet:
                reporter.print(self.describe(entropy))
        tokens_per_step = s.batch_size * s.model.context_length
        start_step = self.step
        timer = StepTimer()
        t0 = time.perf_counter()
        val_loss = None
        end = s.steps if stop_at is None else min(stop_at, s.steps)
        try:
            while self.step < end:
                loss, grad_norm = self.train_step()
                dt = timer.lap()
                record = {"step": self.step, "loss": loss, "lr": self.schedule(self.step - 1),
                          "grad_norm": grad_norm, "tokens": self.step * tokens_per_step,
                          "step_seconds": dt, "tokens_per_s": tokens_per_step / dt}
                done = self.step == end
                if done or (s.eval_every and self.step % s.eval_every == 0):
                    val_loss = evaluate(self.eval_module, self.val_sampler, s.eval_batches, ctx,
                                        s.precision)
                    record.update(val_loss=val_loss, val_ppl=math.exp(min(val_loss, 50)))
                    timer.lap()  # evaluation time is not training throughput
                if not math.isfinite(loss) and self.scaler is None:
                    raise RuntimeError(f"loss became {loss} at step {self.step}; lower --lr")
                if reporter is not None:
                    reporter.step(record)
                if done or (s.ckpt_every and self.step % s.ckpt_every == 0):
                    self.save_checkpoint(ckpt_path)
            if val_loss is None:  # resumed at the end: nothing trained, still report
                val_loss = evaluate(self.eval_module, self.val_sampler, s.eval_batches, ctx,
                                    s.precision)
        finally:
            if reporter is not None:
                reporter.close()
        train_seconds = time.perf_counter() - t0
        trained = self.step - start_step
        summary = {
            "final_val_loss": val_loss,
            "final_val_ppl": math.exp(min(val_loss, 50)),
            "unigram_entropy": entropy,
            "val_over_unigram": val_loss / entropy if entropy else None,
            "steps": self.step,
            "tokens": self.step * tokens_per_step,
            "train_seconds": train_seconds,
            "tokens_per_s": trained * tokens_per_step / max(train_seconds, 1e-9),
            "setup": self.setup_line(),
            "world_size": ctx.world_size,
            "settings": s.to_dict(),
            "parameters": self.model.num_parameters(),
        }
        if reporter is not None:
            outputs = {"metrics": str(out / "metrics.jsonl"), "checkpoint": str(ckpt_path)}
            plot = reporter.plot(entropy) if s.plot else None
            if plot is not None:
                outputs["loss curve"] = str(plot)
            if s.sample_tokens:
                text = self.sample(s.sample_tokens)
                write_text_atomic(out / SAMPLE_NAME, text)
                outputs["sample"] = str(out / SAMPLE_NAME)
                if not s.quiet:
                    reporter.print("[bold]sample:[/bold]")
                    reporter.console.print(text, markup=False, highlight=False)
            outputs["summary"] = str(out / "summary.json")
            summary["outputs"] = outputs
            reporter.summary(summary, outputs)
        ctx.barrier()
        return summary

    def setup_line(self) -> str:
        """One line naming the run's parallel setup."""
        s, ctx = self.s, self.ctx
        ddp = {"bucketed": f"minddp.DDPBucketed({s.bucket_mb:g} MB)",
               "individual": "minddp.DDPIndividualParameters",
               "flat": "minddp.all_reduce_gradients(flat)", "naive": "minddp.all_reduce_gradients",
               "torch": "torch DistributedDataParallel", "none": "no DDP"}[s.ddp]
        opt = {"none": "AdamW", "zero1": "zero1.ShardedOptimizer(AdamW)",
               "torch": "ZeroRedundancyOptimizer(AdamW)"}[s.sharding]
        backend = dist.get_backend() if ctx.distributed else "single process"
        return (f"{ctx.world_size} rank(s), {backend}, {ctx.device.type}, {ddp}, {opt}, "
                f"norm={s.model.norm}, {s.precision}{', compiled' if s.compile else ''}")

    def describe(self, entropy: float) -> str:
        """The opening lines: model, data, batch and parallel setup."""
        s, c = self.s, self.corpus
        m = s.model
        return (
            f"[bold]lab2-train[/bold]: {self.model.num_parameters():,} parameters "
            f"(d_model {m.d_model}, {m.n_layers} layers, {m.n_heads} heads, d_ff {m.d_ff}, "
            f"context {m.context_length})\n"
            f"data: {c.source}: {len(c.train):,} train / {len(c.val):,} val tokens, "
            f"unigram entropy {entropy:.4f} nats\n"
            f"batch: {s.batch_size} x {m.context_length} tokens per step "
            f"({s.batch_size // self.ctx.world_size // s.grad_accum} per rank per micro-step, "
            f"grad_accum {s.grad_accum}), {s.steps} steps, lr {s.lr:g} -> {s.min_lr:g}\n"
            f"setup: {self.setup_line()}\n"
            f"out: {s.out}"
            + (f" (resumed at step {self.step})" if self.step else "")
        )

    def sample(self, n_tokens: int) -> str:
        """Generate ``n_tokens`` after a fixed prompt, deterministically from the seed."""
        gen = torch.Generator(device=self.ctx.device)
        gen.manual_seed(self.s.seed)
        if self.corpus.is_bytes:
            prompt = torch.tensor([list(b"def ")], device=self.ctx.device)
        else:
            prompt = torch.tensor([[int(self.corpus.val[0])]], device=self.ctx.device)
        with autocast_context(self.s.precision, self.ctx.device):
            ids = self.model.generate(prompt, n_tokens, temperature=0.8, top_k=40, generator=gen)
        ids = ids[0].tolist()
        if self.corpus.is_bytes:
            return bytes_as_text(bytes(ids))
        return " ".join(map(str, ids))


def train(ctx: DistContext, settings: TrainSettings) -> dict[str, Any]:
    """Build a :class:`Trainer` for this rank and run it (the function every rank runs)."""
    return Trainer(settings, ctx).run()
