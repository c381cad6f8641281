"""The training loop, run by every rank: :class:`Trainer`, which calls
:func:`lab2_trainer.training.step.train_step` once a step under the learning-rate schedule
of :mod:`lab2_trainer.recipe.schedule`.

Nothing in a step waits for the GPU: losses and gradient norms stay on the device and are
fetched together (one copy, one all-reduce) at logging, evaluation and checkpoint steps,
and the next batch is drawn and copied asynchronously while the current step runs
(:class:`lab2_trainer.data.batches.Prefetcher`). Per-step records are written at those fetches;
their ``step_seconds`` is the mean of the steps since the previous fetch.
"""
from __future__ import annotations

import contextlib
import functools
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lab2_trainer.checkpoint.export import keyed_state
from lab2_trainer.checkpoint.folders import load_trainer_state, trainer_state
from lab2_trainer.checkpoint.folders import resolve as resolve_checkpoint
from lab2_trainer.checkpoint.parts import Placement, load_folder, load_whole
from lab2_trainer.checkpoint.rng import restore as restore_rng
from lab2_trainer.checkpoint.single_file import load_checkpoint
from lab2_trainer.checkpoint.writer import Checkpointer
from lab2_trainer.config import (
    Diverged,
    TrainSettings,
    UsageError,
    flag,
    step_range,
)
from lab2_trainer.data.batches import BatchSampler, Prefetcher, check_batch_layout
from lab2_trainer.data.corpus import compression_baselines, load_corpus, unigram_entropy
from lab2_trainer.models.activation_checkpointing import selective_kind
from lab2_trainer.models.shapes import training_flops_per_token
from lab2_trainer.models.transformer import TransformerLM
from lab2_trainer.parallel.mesh import Mesh, random_seed
from lab2_trainer.parallel.optimizers import MuonSettings, muon_ns_dtype
from lab2_trainer.parallel.parallelize import fused_adamw_available, parallelize, warm_compiler
from lab2_trainer.recipe.schedule import WarmupCosine
from lab2_trainer.reporting.profiling import StepProfiler
from lab2_trainer.reporting.report import (
    SAMPLE_NAME,
    RunReporter,
    bytes_as_text,
    device_label,
    device_peak,
    matmul_parameters,
    mfu,
    precision_name,
    provenance,
    recompute_flops_per_token,
)
from lab2_trainer.runtime.launch import DistContext
from lab2_trainer.runtime.rank0_alone import rank0_alone
from lab2_trainer.runtime.run_folder import atomic_write_text
from lab2_trainer.runtime.wall_clock import WallClock, checkpoint_stall, launch_start
from lab2_trainer.training.step import autocast_context, set_lr, train_step

# ----------------------------------------------------------------------- training loop
# Offset between the training and validation samplers' seeds.
VAL_SEED_OFFSET = 1_000_003


def all_mean(value: torch.Tensor) -> float:
    """Mean of a scalar over all ranks (the value itself without a process group)."""
    value = value.detach().float().reshape(1).clone()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value.item())


def fetch_step_values(losses: list[torch.Tensor], norms: list[torch.Tensor]
                      ) -> tuple[list[float], list[float]]:
    """Bring several steps' losses (averaged over ranks) and gradient norms to the host.

    One all-reduce and one device-to-host copy for all of them: the only synchronisation
    of the steps in between. A collective: every rank calls it at the same steps.
    """
    loss = torch.stack([x.detach().float().reshape(()) for x in losses])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(loss)
        loss /= dist.get_world_size()
    norm = torch.stack([x.detach().float().reshape(()) for x in norms]).to(loss.device)
    values = torch.cat([loss, norm]).tolist()
    return values[: len(losses)], values[len(losses):]


@torch.no_grad()
def evaluate(model: torch.nn.Module, sampler: BatchSampler, n_batches: int, ctx: DistContext,
             precision: str, data_rank: tuple[int, int] | None = None) -> float:
    """Mean validation loss over ``n_batches`` fixed global batches (the same windows at
    every evaluation, so the curve compares like with like); ``data_rank``: this rank's
    (index, count) among the data-parallel ranks (None: every rank is one)."""
    was_training = model.training
    model.eval()
    sampler.draws = 0
    index, count = data_rank or (ctx.rank, ctx.world_size)
    total = torch.zeros((), device=ctx.device)
    for _ in range(n_batches):
        ((x, y),) = sampler.next_local(index, count, 1, ctx.device)
        with autocast_context(precision, ctx.device):
            _, loss = model(x, y)
        total += loss.float()
    model.train(was_training)
    return all_mean(total / n_batches)


def _with_active_clock(run: Callable[..., Any]) -> Callable[..., Any]:
    """``Trainer.run`` with its wall clock the one :func:`checkpoint_stall` counts on."""
    @functools.wraps(run)
    def with_clock(self: Trainer, *args: Any, **kwargs: Any) -> Any:
        with self.clock.active():
            return run(self, *args, **kwargs)
    return with_clock


class Trainer:
    """Everything one rank holds for a run; :meth:`run` trains it to ``settings.steps``.

    Args:
        settings: the run (validated by the caller).
        ctx: this rank's place among the ranks.
    """

    def __init__(self, settings: TrainSettings, ctx: DistContext) -> None:
        # Start-up runs from the launch of lab2-train (or from here) to the first step.
        self.clock = WallClock(launch_start())
        self.s = settings
        self.ctx = ctx
        s = settings
        # With --tp > 1 the ranks are a dp x tp mesh (its groups made here, on every rank);
        # the ranks of one tensor-parallel group draw the same micro-batches.
        self.mesh = Mesh.data_tensor(s.tp) if s.tp > 1 else None
        self.data_rank = ((self.mesh.coordinate("dp"), self.mesh.size("dp"))
                          if self.mesh is not None else (ctx.rank, ctx.world_size))
        # Dropout's masks: its own per data-parallel index, the same over a tp group.
        torch.manual_seed(random_seed(s.seed, self.data_rank[0]))
        check_batch_layout(s.batch_size, self.data_rank[1], s.grad_accum)
        if s.compile:
            # The compiler's worker processes start now, while the data and the model are
            # made, instead of at the first block's compilation.
            warm_compiler(s.compile_backend)
            self.clock.mark("compiler workers")
        self.corpus = load_corpus(s.data, s.vocab_size, s.stdlib_share)
        self.clock.mark("data")
        # A single-file checkpoint is loaded whole here; a sharded one (a step folder) by
        # every rank into its own part once the model is set up (load_folder).
        resume = resolve_checkpoint(s.resume) if s.resume else None
        sharded = resume is not None and resume.is_dir()
        ckpt = None
        if resume is not None:
            ckpt = load_trainer_state(resume) if sharded else load_checkpoint(resume)
            self.clock.mark("checkpoint")
        self.model = TransformerLM(s.model, seed=s.seed, device=ctx.device,
                                   activation_checkpointing=s.activation_checkpointing)
        self.clock.mark("model")
        if ckpt is not None and not sharded:
            try:
                self.model.load_state_dict(ckpt["model"])
            except RuntimeError as exc:
                reason = str(exc).splitlines()[0]
                raise UsageError(f"checkpoint model does not fit: {reason}") from None
        # Before any sharding: FSDP2 replaces the parameters by their shards, tensor
        # parallelism keeps this rank's.
        self.num_parameters = self.model.num_parameters()
        self.flops_per_token = training_flops_per_token(s.model, matmul_parameters(self.model))
        # What the GPU computes: the model's FLOPs plus the recomputed forwards (HFU).
        self.hardware_flops_per_token = self.flops_per_token + recompute_flops_per_token(
            s.model, s.activation_checkpointing)
        compile_spec = ({"backend": s.compile_backend, "mode": s.compile_mode,
                         "scope": s.compile_scope} if s.compile else None)
        self.parallel = parallelize(
            self.model, sharding=s.sharding, ddp=s.ddp, device=ctx.device, lr=s.lr,
            betas=(s.beta1, s.beta2), weight_decay=s.weight_decay,
            fused=fused_adamw_available(ctx.device), compile=compile_spec,
            bucket_mb=s.bucket_mb, bucket_rule=s.bucket_rule,
            reshard_after_forward=s.reshard_after_forward, mesh=self.mesh,
            sequence_parallel=s.sequence_parallel,
            float8=s.fp8_recipe if s.precision == "fp8" else None,
            muon=(MuonSettings(s.muon_lr, ns_dtype=muon_ns_dtype(ctx.device))
                  if s.optimizer == "muon" else None))
        self.clock.mark("parallelize")
        # How tensor parallelism cut the model (None without): what checkpoints map.
        self.layout = getattr(self.parallel, "layout", None)
        # Evaluation skips the DDP wrapper: no gradients, nothing to average.
        self.eval_module = self.parallel.eval_module
        self.optimizer = self.parallel.optimizer
        self.schedule = WarmupCosine(s.lr, s.min_lr, s.warmup, s.steps)
        T = s.model.context_length
        self.sampler = BatchSampler(self.corpus.train, T, s.batch_size, s.seed,
                                    mix=self.corpus.mix)
        self.val_sampler = BatchSampler(self.corpus.val, T, s.batch_size, s.seed + VAL_SEED_OFFSET)
        self.scaler = None
        if s.precision == "fp16":
            self.scaler = torch.amp.GradScaler(ctx.device.type)
        self.step = 0
        if sharded:
            # The bucket order first (zero1 rebuilds its buckets), then each rank's part.
            self.set_gradient_order(ckpt.get("gradient_order"))
            load_folder(resume, self.model, self.optimizer, s.sharding, self.layout)
        if ckpt is not None:
            self._restore(ckpt)
            self.clock.mark("checkpoint")
        # Every rank, here (it makes the writer's process group).
        self.checkpointer = Checkpointer(s.out, self.model, self.optimizer, s.sharding,
                                         ctx.device, asynchronous=s.ckpt_async,
                                         keep_last=s.keep_last, threads=s.ckpt_threads,
                                         layout=self.layout)
        self.clock.mark("checkpoint writer")
        # After the restore, so it starts from the checkpoint's position in the stream.
        self.batches = Prefetcher(self.sampler, *self.data_rank, s.grad_accum, ctx.device)
        self.peak = device_peak(ctx.device)
        self.clock.mark("batches")

    def set_gradient_order(self, order: list[int] | None) -> None:
        try:
            self.parallel.set_gradient_order(order)
        except ValueError as exc:
            raise UsageError(f"checkpoint gradient order does not fit: {exc}") from None

    def _restore(self, ckpt: dict[str, Any]) -> None:
        if not ckpt.get("sharded"):
            try:
                self._load_whole_optimizer_state(ckpt)
            except (ValueError, KeyError, RuntimeError) as exc:
                raise UsageError(f"checkpoint optimizer state does not fit: {exc}") from None
        self.sampler.load_state_dict(ckpt["sampler"])
        # This rank's own generators (dropout's masks), or fresh ones on another layout.
        note = restore_rng(ckpt, self.ctx.device, rank=self.ctx.rank,
                           world_size=self.ctx.world_size, tp=self.s.tp,
                           dp_index=self.data_rank[0], seed=self.s.seed)
        if note is not None and self.ctx.is_main and self.s.model.dropout > 0:
            print(f"lab2-train: note: {note}", file=sys.stderr, flush=True)
        if self.scaler is not None and ckpt.get("scaler"):
            self.scaler.load_state_dict(ckpt["scaler"])
        self.set_gradient_order(ckpt.get("gradient_order"))
        self.step = int(ckpt["step"])

    def _load_whole_optimizer_state(self, ckpt: dict[str, Any]) -> None:
        """A single-file checkpoint's optimizer state: loaded by the family, or on a cut
        model each rank's part of it taken as from a step folder."""
        if self.layout is None:
            self.parallel.load_full_optimizer_state(ckpt["optimizer"])
            return
        whole = keyed_state(self.model, ckpt["optimizer"], self.s.weight_decay,
                            self.s.optimizer)
        load_whole(self.model, self.optimizer, self.s.sharding, whole,
                   Placement.here(self.layout), only_state=True)

    def save_checkpoint(self) -> None:
        """Save a sharded checkpoint of this step: every rank its own part, in the
        background unless ``--no-ckpt-async`` (:class:`Checkpointer`); nothing gathered."""
        self.checkpointer.save(self.step, trainer_state(self) if self.ctx.is_main else None)

    @_with_active_clock
    def run(self, stop_at: int | None = None) -> dict[str, Any]:
        """Train to ``settings.steps``, one :func:`train_step` a step; on rank 0 also
        report, plot, sample and summarise.

        Args:
            stop_at: stop early after this step, with a checkpoint, as if interrupted there
                (the schedule still spans ``settings.steps``).

        Returns:
            The summary (on every rank; file paths and figures are rank 0's).
        """
        s, ctx, clock = self.s, self.ctx, self.clock
        out = Path(s.out)
        reporter = None
        entropy = None
        compression = None
        if ctx.is_main:
            out.mkdir(parents=True, exist_ok=True)
            reporter = RunReporter(out, s.steps, self.step, quiet=s.quiet, log_every=s.log_every)
            entropy = unigram_entropy(self.corpus.train, self.corpus.vocab_size)
            # gzip's and xz's figures on the validation split (cached with the corpus).
            compression = compression_baselines(self.corpus)
            if not s.quiet:
                reporter.print(self.describe(entropy))
        tokens_per_step = s.batch_size * s.model.context_length
        start_step = self.step
        t0 = time.perf_counter()
        val_loss = None
        end = s.steps if stop_at is None else min(stop_at, s.steps)
        pending: list[tuple[int, float, torch.Tensor, torch.Tensor]] = []
        windows: list[tuple[int, float]] = []  # (steps, seconds) between fetches
        first_step_s: float | None = None  # this invocation's first step (compilation)
        profiler = None
        if s.profile_steps:
            profiler = StepProfiler(*step_range(flag("profile_steps"), s.profile_steps), out,
                                    ctx.rank, ctx.device)
        clock.switch("training")
        window_start = time.perf_counter()
        try:
            while self.step < end:
                with profiler.step(self.step + 1) if profiler else contextlib.nullcontext():
                    set_lr(self.optimizer, self.schedule(self.step))
                    loss, grad_norm = train_step(
                        self.parallel, self.batches.next(), precision=s.precision,
                        device=ctx.device, clip=s.clip, scaler=self.scaler,
                        backward_thread=s.backward_thread)
                    # The GPU has this step's work queued: draw and send the next batch,
                    # and (after the first step: not during compilation) make some of the
                    # checkpoint's pinned buffers.
                    self.batches.prefetch()
                    if self.step > start_step:
                        self.checkpointer.make_buffers()
                    self.step += 1
                if profiler is not None and profiler.due(self.step):
                    profiler.wait_for_device()  # the traced steps' own work: training
                    exporting = time.perf_counter()
                    with clock.phase("other"):
                        profiler.finish()
                    window_start += time.perf_counter() - exporting  # not a step's time
                pending.append((self.step, self.schedule(self.step - 1), loss, grad_norm))
                done = self.step == end
                first = self.step == start_step + 1  # timed alone: it holds the compilation
                evaluate_now = done or bool(s.eval_every and self.step % s.eval_every == 0)
                checkpoint_now = done or bool(s.ckpt_every and self.step % s.ckpt_every == 0)
                if not (first or evaluate_now or checkpoint_now or self.step % s.log_every == 0):
                    continue
                records = self._fetch_records(pending, window_start)
                windows.append((len(pending), time.perf_counter() - window_start))
                if first:
                    first_step_s = windows[-1][1]
                pending = []
                records[-1]["wall_clock"] = clock.split(first_step_s, steady_step(windows))
                for record in records:
                    if not math.isfinite(record["loss"]) and self.scaler is None:
                        # The same averaged loss on every rank: rank 0 alone says it.
                        raise Diverged(f"the loss became {record['loss']} at step "
                                       f"{record['step']} (the run diverged): lower --lr "
                                       f"(it is {s.lr:g})")
                # A save that finds the previous write done starts now: it stalls for the
                # copy to CPU memory only, and its write overlaps the evaluation. One that
                # would wait for the previous write (or a write that hangs) comes after the
                # log lines instead, so that it never holds back the losses already trained.
                save_now = checkpoint_now and not self.checkpointer.in_flight
                if save_now:
                    with checkpoint_stall():
                        self.save_checkpoint()
                if evaluate_now:
                    with clock.phase("evaluation", carve_compilation=True):
                        val_loss = evaluate(self.eval_module, self.val_sampler, s.eval_batches,
                                            ctx, s.precision, self.data_rank)
                    records[-1].update(val_loss=val_loss, val_ppl=math.exp(min(val_loss, 50)))
                if reporter is not None:
                    with clock.phase("other"):
                        for record in records:
                            reporter.step(record)
                if checkpoint_now and not save_now:
                    with checkpoint_stall():
                        self.save_checkpoint()
                # Evaluation and checkpoints are not training throughput.
                window_start = time.perf_counter()
            if val_loss is None:  # resumed at the end: nothing trained, still report
                with clock.phase("evaluation", carve_compilation=True):
                    val_loss = evaluate(self.eval_module, self.val_sampler, s.eval_batches, ctx,
                                        s.precision, self.data_rank)
            # The end of the run waits for the save in flight: a stall too.
            with checkpoint_stall():
                self.checkpointer.finish()  # a failed last save fails the run
        finally:
            clock.switch("other")
            if profiler is not None:  # the steps traced so far, when the run ends early
                profiler.finish()
            if reporter is not None:
                reporter.close()
        train_seconds = time.perf_counter() - t0
        trained = self.step - start_step
        summary = {
            "final_val_loss": val_loss,
            "final_val_ppl": math.exp(min(val_loss, 50)),
            "unigram_entropy": entropy,
            "val_over_unigram": val_loss / entropy if entropy else None,
            "compression": compression,
            "steps": self.step,
            "tokens": self.step * tokens_per_step,
            "train_seconds": train_seconds,
            "tokens_per_s": trained * tokens_per_step / max(train_seconds, 1e-9),
            **self.throughput(windows),
            "setup": self.setup_line(),
            "world_size": ctx.world_size,
            "settings": s.to_dict(),
            "parameters": self.num_parameters,
            # Seconds each save kept training waiting (the copy to CPU memory, and any wait
            # for the previous save), and the end of the run for the last one.
            "checkpoint_stalls": self.checkpointer.stalls,
            "checkpoint_final_wait_s": self.checkpointer.final_wait,
        }
        # A collective with zero3 and fsdp (the whole model is gathered onto rank 0).
        with clock.phase("sampling"):
            sample_model = self.sampling_model() if s.sample_tokens else None
        # Rank 0's work alone: the others wait without --timeout bounding a long sample.
        rank0_alone(ctx, "at the end of the run (plot, sample, summary)",
                    lambda: self._finish(reporter, summary, entropy, sample_model, profiler,
                                         first_step_s, windows), s.timeout)
        if reporter is None:
            summary["wall_clock"] = clock.split(first_step_s, steady_step(windows))
        return summary

    def _finish(self, reporter: RunReporter | None, summary: dict[str, Any],
                entropy: float | None, sample_model: TransformerLM | None,
                profiler: StepProfiler | None, first_step_s: float | None,
                windows: list[tuple[int, float]]) -> None:
        """Rank 0's end of the run: the loss curve, the sample, the summary."""
        s, clock, out = self.s, self.clock, Path(self.s.out)
        if reporter is not None:
            summary.update(provenance())
            outputs = {"metrics": str(out / "metrics.jsonl")}
            if self.checkpointer.saved:
                outputs["checkpoint"] = str(self.checkpointer.saved[-1])
            plot = reporter.plot(entropy, summary["compression"]) if s.plot else None
            if plot is not None:
                outputs["loss curve"] = str(plot)
            if profiler is not None and profiler.written is not None:
                outputs["profile trace"] = str(profiler.written)
            if s.sample_tokens:
                with clock.phase("sampling"):
                    text = self.sample(s.sample_tokens, sample_model)
                atomic_write_text(out / SAMPLE_NAME, text)
                outputs["sample"] = str(out / SAMPLE_NAME)
                if not s.quiet:
                    reporter.print("[bold]sample:[/bold]")
                    reporter.console.print(text, markup=False, highlight=False)
            outputs["summary"] = str(out / "summary.json")
            summary["outputs"] = outputs
            summary["wall_clock"] = clock.split(first_step_s, steady_step(windows))
            reporter.summary(summary, outputs)

    def _fetch_records(self, pending: list[tuple[int, float, torch.Tensor, torch.Tensor]],
                       since: float) -> list[dict[str, Any]]:
        """The metrics records of the steps in ``pending`` (a collective: see
        :func:`fetch_step_values`); time per step is their mean since ``since``."""
        losses, norms = fetch_step_values([p[2] for p in pending], [p[3] for p in pending])
        seconds = (time.perf_counter() - since) / len(pending)
        tokens_per_step = self.s.batch_size * self.s.model.context_length
        tokens_per_s = tokens_per_step / seconds
        utilisation = mfu(tokens_per_s, self.flops_per_token, self.peak, self.ctx.world_size)
        hardware = mfu(tokens_per_s, self.hardware_flops_per_token, self.peak,
                       self.ctx.world_size)
        records = []
        for (step, lr, _, _), loss, norm in zip(pending, losses, norms):
            record = {"step": step, "loss": loss, "lr": lr, "grad_norm": norm,
                      "tokens": step * tokens_per_step, "step_seconds": seconds,
                      "tokens_per_s": tokens_per_s}
            if utilisation is not None:
                record["mfu"] = utilisation
                record["hfu"] = hardware
            records.append(record)
        return records

    def throughput(self, windows: list[tuple[int, float]]) -> dict[str, Any]:
        """Training throughput and MFU for the summary, from the timed windows between
        fetches; the first window (compilation, warm-up) is left out when there are others.
        Evaluation and checkpoints are never in a window."""
        steady = windows[1:] or windows
        steps = sum(n for n, _ in steady)
        seconds = sum(t for _, t in steady)
        tokens_per_s = None
        if steps and seconds > 0:
            tokens_per_s = steps * self.s.batch_size * self.s.model.context_length / seconds
        utilisation = hardware = None
        if tokens_per_s is not None:
            utilisation = mfu(tokens_per_s, self.flops_per_token, self.peak, self.ctx.world_size)
            hardware = mfu(tokens_per_s, self.hardware_flops_per_token, self.peak,
                           self.ctx.world_size)
        return {
            "step_tokens_per_s": tokens_per_s,
            "mfu": utilisation,
            "hfu": hardware,
            "mfu_peak": self.peak_line(),
            "flops_per_token": self.flops_per_token,
            "hardware_flops_per_token": self.hardware_flops_per_token,
        }

    def peak_line(self) -> str | None:
        """The peak MFU is measured against, in words (None without one)."""
        if self.peak is None:
            return None
        per_rank = f" per rank x {self.ctx.world_size}" if self.ctx.world_size > 1 else ""
        return f"{self.peak.name}, {self.peak.flops / 1e12:,.0f} TFLOP/s{per_rank}"

    def setup_line(self) -> str:
        """One line naming the run's parallel setup."""
        s, ctx = self.s, self.ctx
        ddp = {"bucketed": f"minddp.DDPBucketed({s.bucket_mb:g} MB)",
               "individual": "minddp.DDPIndividualParameters",
               "flat": "minddp.all_reduce_gradients(flat)", "naive": "minddp.all_reduce_gradients",
               "torch": "torch DistributedDataParallel", "none": "no DDP"}[s.ddp]
        adamw = "AdamW(fused)" if fused_adamw_available(ctx.device) else "AdamW"
        if s.optimizer == "muon":  # the blocks' matrices; AdamW steps the rest
            adamw = f"zero1.Muon + {adamw}"
        buckets = f"{s.bucket_mb:g} MB buckets"
        opt = {"none": adamw,
               "zero1": f"zero1.ShardedOptimizer(stage 1, reduce-scatter, {buckets}, {adamw})",
               "zero2": f"zero1.ShardedOptimizer(stage 2, reduce-scatter, {buckets}, {adamw})",
               "zero1-allreduce": f"zero1.ShardedOptimizer(stage 1, broadcast, {adamw})",
               "torch": f"ZeroRedundancyOptimizer({adamw})",
               "zero3": f"zero1.shard_model(reshard_after_forward={s.reshard_after_forward}) "
                        f"+ zero1.Stage3Optimizer({adamw})",
               "fsdp": f"FSDP2 fully_shard(reshard_after_forward="
                       f"{s.reshard_after_forward}) + {adamw}"}[s.sharding]
        backend = dist.get_backend() if ctx.distributed else "single process"
        ranks = f"{ctx.world_size} rank(s)"
        if self.mesh is not None:  # DDP and the sharding act over the data-parallel ranks
            sp = " and sequence" if s.sequence_parallel else ""
            ranks += f" as {self.mesh.describe()} (minitp tensor{sp} parallel)"
        checkpointing = ("" if s.activation_checkpointing == "none" else
                         f", activation checkpointing {self._checkpointing_label()}")
        return (f"{ranks}, {backend}, {ctx.device.type}, {ddp}, {opt}, "
                f"norm={s.model.norm}, {precision_name(s.precision, s.fp8_recipe)}"
                f"{self._compile_label()}{checkpointing}")

    def _checkpointing_label(self) -> str:
        kind = self.s.activation_checkpointing
        if kind == "selective":
            return f"selective ({selective_kind()})"
        return kind

    def _compile_label(self) -> str:
        s = self.s
        if not s.compile:
            return ""
        mode = f", {s.compile_mode}" if s.compile_mode else ""
        return f", compiled ({s.compile_backend}{mode}, {s.compile_scope})"

    def describe(self, entropy: float) -> str:
        """The opening lines: model, data, batch and parallel setup."""
        s, c = self.s, self.corpus
        m = s.model
        peak = self.peak_line() or (f"no known bf16 peak for {device_label(self.ctx.device)} "
                                    "(not reported)")
        return (
            f"[bold]lab2-train[/bold]: {self.num_parameters:,} parameters "
            f"(d_model {m.d_model}, {m.n_layers} layers, {m.n_heads} heads, d_ff {m.d_ff}, "
            f"context {m.context_length})\n"
            f"data: {c.describe()}: {len(c.train):,} train / {len(c.val):,} val tokens, "
            f"unigram entropy {entropy:.4f} nats\n"
            f"batch: {s.batch_size} x {m.context_length} tokens per step "
            f"({s.batch_size // self.data_rank[1] // s.grad_accum} per rank per micro-step, "
            f"grad_accum {s.grad_accum}), {s.steps} steps, lr {s.lr:g} -> {s.min_lr:g}"
            + (f", Muon lr {s.muon_lr:g} -> {s.muon_lr * s.min_lr / s.lr:g}"
               if s.optimizer == "muon" else "") + "\n"
            f"setup: {self.setup_line()}\n"
            f"MFU: {self.flops_per_token / 1e6:,.1f} MFLOP per token against {peak}"
            + (f" (HFU: {self.hardware_flops_per_token / 1e6:,.1f} with the recompute)"
               if self.hardware_flops_per_token != self.flops_per_token else "") + "\n"
            f"out: {s.out}"
            + (f" (resumed at step {self.step})" if self.step else "")
        )

    def sampling_model(self) -> TransformerLM | None:
        """The model to sample from on rank 0: the trained one itself, or with zero3, fsdp
        and tensor parallelism (whose parameters are shards) an unsharded copy built from
        the gathered state dict. A collective with those; None on the other ranks there."""
        if self.parallel.sharding not in ("zero3", "fsdp") and self.mesh is None:
            return self.model
        state = self.parallel.full_model_state(self.ctx.rank)
        if state is None:
            return None
        model = TransformerLM(self.s.model, seed=self.s.seed, device=self.ctx.device)
        model.load_state_dict(state)
        return model

    def sample(self, n_tokens: int, model: TransformerLM | None = None) -> str:
        """Generate ``n_tokens`` after a fixed prompt, deterministically from the seed,
        with ``model`` (default: :meth:`sampling_model`'s)."""
        model = model if model is not None else self.sampling_model()
        gen = torch.Generator(device=self.ctx.device)
        gen.manual_seed(self.s.seed)
        if self.corpus.is_bytes:
            prompt = torch.tensor([list(b"def ")], device=self.ctx.device)
        else:
            prompt = torch.tensor([[int(self.corpus.val[0])]], device=self.ctx.device)
        with autocast_context(self.s.precision, self.ctx.device):
            ids = model.generate(prompt, n_tokens, temperature=0.8, top_k=40, generator=gen)
        ids = ids[0].tolist()
        if self.corpus.is_bytes:
            return bytes_as_text(bytes(ids))
        return " ".join(map(str, ids))


def steady_step(windows: list[tuple[int, float]]) -> float | None:
    """Mean seconds per step of the timed windows after the first (the first step alone,
    see :meth:`Trainer.run`); None before there is one."""
    steps = sum(n for n, _ in windows[1:])
    return sum(t for _, t in windows[1:]) / steps if steps else None


def train(ctx: DistContext, settings: TrainSettings) -> dict[str, Any]:
    """Build a :class:`Trainer` for this rank and run it (the function every rank runs)."""
    return Trainer(settings, ctx).run()
