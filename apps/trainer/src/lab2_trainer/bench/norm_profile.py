"""``lab2-train bench norm --profile``: where the host time of a step goes, per norm layer.

For each norm, a few steps of the full model run under ``torch.profiler`` (after the usual
warm-up). Two tables come out:

- **norm ops**: the norm's forward op and its backward node, CPU µs per call (the op's whole
  time, children included: what one norm call costs the host inside the model), device µs
  per call on CUDA, calls per step, and the norm's share of the step's host time. Which
  events belong to the norm is found by running one norm module alone first: the forward's
  top-level profiler events (``RMSNormFunction``, ``aten::rms_norm``, ``aten::layer_norm``...)
  and the backward nodes of its autograd graph (profiled as ``autograd::engine::
  evaluate_function: <node>``). Where such a name also occurs elsewhere in the model (the
  composite ``nn.RMSNorm`` of the CPU has ``MulBackward0``, ``PowBackward0``...), the figure
  is the mean over all its calls and the row says ``exact: no``.
- **top ops**: the ops with the most self CPU time per step, with calls per step and CPU µs
  per call (self and with children).

What a profile cannot show: Python that runs outside any op (``nn.Module.__call__``, the
code of ``tritonnorm.rms_norm`` and ``autograd.Function.apply`` before the op's record
begins), and the weights' ``AccumulateGrad`` (one node type for every parameter). The
profiler also adds its own cost to every op, so compare the norms with each other here;
``lab2bench norm-host`` measures the unprofiled cost of whole calls.
"""

from __future__ import annotations

import argparse
import collections
import os
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, record_function

from lab2_trainer.bench.steps import make_optimizer, make_step
from lab2_trainer.bench.workload import (
    autocast,
    build_config,
    build_model,
    free_memory,
    random_batch,
)
from lab2bench.devices import synchronize
from lab2bench.suites import SuiteOutput

STEP_LABEL = "lab2.bench.step"
BACKWARD_PREFIX = "autograd::engine::evaluate_function: "
ACCUMULATE = "torch::autograd::AccumulateGrad"

SUMMARY_COLUMNS = ["preset", "norm", "mode", "norm_calls_per_step", "fwd_op", "fwd_cpu_us",
                   "fwd_device_us", "bwd_op", "bwd_cpu_us", "bwd_device_us", "exact",
                   "norm_cpu_ms_per_step", "step_cpu_ms", "norm_share"]
FLOATFMT = {"fwd_cpu_us": ".1f", "fwd_device_us": ".1f", "bwd_cpu_us": ".1f",
            "bwd_device_us": ".1f", "norm_cpu_ms_per_step": ".2f", "step_cpu_ms": ".2f",
            "norm_share": ".2f", "calls_per_step": ".0f", "self_cpu_us": ".1f", "cpu_us": ".1f",
            "self_cpu_ms_per_step": ".3f", "device_us": ".1f"}
TOP_COLUMNS = ["rank", "op", "calls_per_step", "self_cpu_us", "cpu_us", "self_cpu_ms_per_step",
               "device_us"]


def norm_event_names(kind: str, dim: int, eps: float, device: torch.device,
                     precision: str) -> tuple[type[nn.Module], list[str], list[str]]:
    """The norm module's class, and the profiler names of one call's forward (top-level
    events) and backward (one per autograd node, AccumulateGrad left out), with repeats.

    A call is what the model makes at all but its first norm: the residual add and the
    norm after it (``add_and_norm``, one fused call with tritonnorm)."""
    from lab2_trainer.model import add_and_norm, make_norm

    module = make_norm(kind, dim, eps).to(device)
    x = torch.randn(2, 4, dim, device=device, requires_grad=True)
    branch = torch.randn(2, 4, dim, device=device, requires_grad=True)
    with autocast(precision, device):  # warm: first calls may take other paths (compile)
        add_and_norm(module, x, branch)
    with (torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof,
          autocast(precision, device)):
        y = add_and_norm(module, x, branch)[0]
    forward = [e.name for e in prof.events() if e.cpu_parent is None]
    backward = []
    seen: set[int] = set()
    stack = [y.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.name() != ACCUMULATE:
            backward.append(BACKWARD_PREFIX + node.name())
        stack.extend(next_node for next_node, _ in node.next_functions)
    return type(module), forward, backward


def _device_time(evt: Any, self_only: bool = False) -> float:
    names = (["self_device_time_total", "self_cuda_time_total"] if self_only
             else ["device_time_total", "cuda_time_total"])
    for name in names:
        value = getattr(evt, name, None)
        if value is not None:
            return float(value)
    return 0.0


def _per_norm_call(averages: dict[str, Any], names: list[str],
                   norm_calls: int) -> dict[str, Any] | None:
    """CPU and device µs of one norm call from the events named ``names`` (with repeats);
    ``exact`` when each name occurred exactly as often as the norm calls imply."""
    cpu = device = 0.0
    exact = True
    parts = []
    for name, mult in collections.Counter(names).items():
        evt = averages.get(name)
        if evt is None or evt.count == 0:
            return None
        expected = mult * norm_calls
        exact = exact and evt.count == expected
        cpu_us = evt.cpu_time_total / evt.count
        dev_us = _device_time(evt) / evt.count
        cpu += mult * cpu_us
        device += mult * dev_us
        parts.append({"name": name, "per_norm_call": mult, "count": evt.count,
                      "expected": expected, "cpu_us": cpu_us,
                      "self_cpu_us": evt.self_cpu_time_total / evt.count,
                      "device_us": dev_us})
    return {"cpu_us": cpu, "device_us": device, "exact": exact, "parts": parts}


def _short_op(names: list[str]) -> str:
    unique = list(dict.fromkeys(n.removeprefix(BACKWARD_PREFIX) for n in names))
    return " + ".join(unique) if len(unique) <= 3 else f"{len(names)} nodes ({unique[0]}, ...)"


def profile_norm(args: argparse.Namespace, preset: str, norm: str, *, mode: str, steps: int,
                 trace_path: os.PathLike[str] | None = None) -> tuple[dict, list[dict]]:
    """Profile ``steps`` steps of ``mode`` of the preset's model with ``norm``.

    Returns the summary row and the top-ops rows (all ops, sorted by self CPU time).
    """
    device = torch.device(args.device)
    config = build_config(preset, context_length=args.context_length,
                          vocab_size=args.vocab_size, norm=norm, overrides=args.overrides)
    norm_cls, fwd_names, bwd_names = norm_event_names(config.norm, config.d_model, config.eps,
                                                      device, args.precision)
    model = build_model(config, device, seed=args.seed)
    norms_per_step = sum(1 for m in model.modules() if type(m) is norm_cls)
    batch = random_batch(config, args.batch_size, device, seed=args.seed)
    optimizer = make_optimizer(model) if mode == "train_step" else None
    step = make_step(model, batch, mode=mode, precision=args.precision, device=device,
                     optimizer=optimizer, backward_thread=args.backward_thread)
    for _ in range(max(args.warmup, 1)):
        step()
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    # One profiled but discarded step first: the profiler's own start-up (CUPTI on CUDA)
    # lands there, not in the figures.
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule) as prof:
        for i in range(1 + steps):
            with record_function(STEP_LABEL):
                step()
            if i == steps:
                synchronize(device)  # the last kernels belong to the profile
            prof.step()
    averages = {evt.key: evt for evt in prof.key_averages()}
    if trace_path is not None:
        from lab2bench.profiling import export_chrome_trace

        export_chrome_trace(prof, trace_path)
    del model, optimizer, step, batch, prof
    free_memory(device)

    norm_calls = norms_per_step * steps
    step_evt = averages.get(STEP_LABEL)
    step_cpu_ms = step_evt.cpu_time_total / step_evt.count / 1e3 if step_evt else None
    fwd = _per_norm_call(averages, fwd_names, norm_calls)
    bwd = _per_norm_call(averages, bwd_names, norm_calls) if mode != "forward" else None
    summary: dict[str, Any] = {
        "preset": preset, "norm": config.norm, "mode": mode, "precision": args.precision,
        "steps": steps, "norm_calls_per_step": norms_per_step,
        "fwd_op": _short_op(fwd_names), "bwd_op": _short_op(bwd_names) if bwd else None,
        "fwd_cpu_us": fwd["cpu_us"] if fwd else None,
        "fwd_device_us": fwd["device_us"] if fwd and device.type == "cuda" else None,
        "bwd_cpu_us": bwd["cpu_us"] if bwd else None,
        "bwd_device_us": bwd["device_us"] if bwd and device.type == "cuda" else None,
        "exact": "yes" if all(p is None or p["exact"] for p in (fwd, bwd)) else "no",
        "fwd_events": fwd["parts"] if fwd else [], "bwd_events": bwd["parts"] if bwd else [],
        "step_cpu_ms": step_cpu_ms,
    }
    norm_us = sum(p["cpu_us"] for p in (fwd, bwd) if p)
    summary["norm_cpu_ms_per_step"] = norms_per_step * norm_us / 1e3
    summary["norm_share"] = (summary["norm_cpu_ms_per_step"] / step_cpu_ms
                             if step_cpu_ms else None)

    ops = [evt for key, evt in averages.items() if key != STEP_LABEL and evt.count
           and evt.self_cpu_time_total > 0]
    ops.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    top = []
    for rank, evt in enumerate(ops, start=1):
        top.append({
            "preset": preset, "norm": config.norm, "mode": mode, "rank": rank, "op": evt.key,
            "calls_per_step": evt.count / steps,
            "self_cpu_us": evt.self_cpu_time_total / evt.count,
            "cpu_us": evt.cpu_time_total / evt.count,
            "self_cpu_ms_per_step": evt.self_cpu_time_total / steps / 1e3,
            "device_us": _device_time(evt) / evt.count if device.type == "cuda" else None,
        })
    return summary, top


def run_profiles(args: argparse.Namespace, norms: list[str]) -> SuiteOutput:
    """Profile every (preset, norm); print the tables, and with ``--out`` write
    ``norm-profile.jsonl``, ``norm-profile.md`` and, with ``--profile-trace``, a Chrome
    trace per profile."""
    out = SuiteOutput("norm-profile", args.out)
    steps = args.profile_steps or (2 if args.quick else 5)
    summaries, tops = [], []
    for preset in args.presets:
        for norm in norms:
            trace = (out.out_dir / f"norm-profile-{preset}-{norm}.trace.json"
                     if out.out_dir is not None and args.profile_trace else None)
            summary, top = profile_norm(args, preset, norm, mode=args.profile_mode,
                                        steps=steps, trace_path=trace)
            keys = ("preset", "norm", "mode", "precision", "steps")
            config = {k: summary[k] for k in keys}
            config.update(table="norm_ops", batch_size=args.batch_size,
                          context_length=args.context_length, device=args.device)
            summaries.append(out.add(config, {k: v for k, v in summary.items()
                                              if k not in config}))
            shown = []
            for row in top[: args.profile_top]:
                config = {k: row[k] for k in ("preset", "norm", "mode", "rank", "op")}
                config.update(table="top_ops", steps=steps, device=args.device)
                shown.append(out.add(config, {k: v for k, v in row.items() if k not in config}))
            tops.append((preset, norm, shown))
    on_cuda = args.device != "cpu"
    columns = [c for c in SUMMARY_COLUMNS if on_cuda or not c.endswith("device_us")]
    out.table(columns, rows=summaries, floatfmt=FLOATFMT,
              title=f"norm ops per call inside the model (torch.profiler, {args.profile_mode}, "
                    f"{args.precision}, batch {args.batch_size} x context "
                    f"{args.context_length}, {args.device}, {steps} profiled steps)")
    out.note("CPU µs per call include the op's children (for the backward: the autograd "
             "node as the engine runs it); device µs: the kernels it launched. "
             "norm_share = norm calls x (fwd + bwd) / the step's host time under the profiler. "
             "exact = no: a name also occurs outside the norm, its figure is a mean over all "
             "its calls. Python outside ops and the weights' AccumulateGrad are not counted; "
             "the profiler adds its own cost per op (lab2bench norm-host measures whole calls "
             "without it).")
    columns = [c for c in TOP_COLUMNS if on_cuda or c != "device_us"]
    for preset, norm, shown in tops:
        out.table(columns, rows=shown, floatfmt=FLOATFMT,
                  title=f"top ops by self CPU time: {preset}, norm={norm} (µs per call)")
    return out
