"""Checks of the command line, the machine and a checkpoint that must pass before any rank
starts: so that bad input costs one line on stderr, exit code 2, and no file written.

(Each setting's own range, e.g. ``--clip nan`` or ``--lr inf``, is its field's check in
:mod:`lab2_trainer.settings`, run by ``TrainSettings.validate``.)

* :func:`check_out_path`: ``--out`` is a folder, or can become one;
* :func:`check_memory`: the model, its gradients and AdamW state (plus the logits of one
  micro-batch) fit the memory this machine has (a lower bound: a run refused here could
  never have run);
* :func:`check_checkpoint_fits`: a checkpoint's model tensors, optimizer state (zero1's
  checks, on ``meta`` tensors), random state and sampler position fit the run.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from lab2_trainer.errors import UsageError

GIB = 1024**3
# Per process: the interpreter, torch and the data maps (a lower bound).
PROCESS_BYTES = 200 * 1024**2


def check_out_path(out: str) -> None:
    """``out`` is an existing folder, or a path where a folder can be made.

    Raises:
        UsageError: it is a file, a parent is a file, or it cannot be written.
    """
    p = Path(out).expanduser()
    if p.exists() and not p.is_dir():
        raise UsageError(f"--out {out} exists and is not a folder (nothing was written)")
    probe = p
    while not probe.exists():
        parent = probe.parent
        if parent == probe:
            break
        probe = parent
    if probe.exists() and not probe.is_dir():
        raise UsageError(f"--out {out}: {probe} is a file, not a folder (nothing was written)")
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out}: {probe} is not writable (nothing was written)")


def shape_model(config: Any):
    """The model with ``meta`` tensors: shapes and names only, no memory, no init."""
    import torch

    from lab2_trainer.model import TransformerLM

    class _Shapes(TransformerLM):
        def reset_parameters(self, seed: int = 0) -> None:  # nothing to fill on meta
            pass

    with torch.device("meta"):
        return _Shapes(config)


def available_memory() -> int | None:
    """Bytes this process may still allocate: MemAvailable, capped by a cgroup limit."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        with contextlib.suppress(ValueError, OSError, AttributeError):
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    cgroups = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
               ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                "/sys/fs/cgroup/memory/memory.usage_in_bytes"))
    for limit_file, usage_file in cgroups:
        try:
            limit = Path(limit_file).read_text().strip()
            if limit != "max" and int(limit) < 2**60:
                found.append(int(limit) - int(Path(usage_file).read_text().strip()))
            break
        except (OSError, ValueError):
            continue
    return min(found) if found else None


def _fmt(n: float) -> str:
    return f"{n / GIB:,.1f} GiB" if n < 1024 * GIB else f"{n / 1024 / GIB:,.1f} TiB"


def training_state_parts(n: int, sharding: str, world_size: int,
                         reshard_after_forward: bool = True) -> dict[str, int]:
    """:func:`training_state_bytes` item by item: ``parameters``, ``gradients`` and
    ``optimizer`` bytes per rank (the gathered weights of fsdp without resharding count
    among the parameters)."""
    shards = max(1, world_size)
    params, grads, state = 4 * n, 4 * n, 8 * n // shards
    if sharding == "none":
        state = 8 * n
    elif sharding == "zero2":
        grads = 4 * n // shards
    elif sharding == "fsdp":
        params = 4 * n // shards + (0 if reshard_after_forward else 4 * n)
        grads = 4 * n // shards
    return {"parameters": params, "gradients": grads, "optimizer": state}


def training_state_bytes(n: int, sharding: str, world_size: int,
                         reshard_after_forward: bool = True) -> int:
    """Bytes per rank of fp32 weights (4), gradients (4) and AdamW's two moments (8) of
    ``n`` parameters, by sharding kind (a lower bound: no bucket or gathered block):

    * none: 4 + 4 + 8 per parameter;
    * zero1, zero1-allreduce, torch (state sharded): 4 + 4 + 8/N;
    * zero2 (gradients sharded too): 4 + (4 + 8)/N;
    * fsdp (parameters too): (4 + 4 + 8)/N, and with reshard_after_forward off the whole
      gathered weights (4) through the backward besides.
    """
    return sum(training_state_parts(n, sharding, world_size, reshard_after_forward).values())


def check_memory(settings: Any, world_size: int, device_type: str, *,
                 available: int | None = None) -> None:
    """Refuse a run whose model cannot fit: weights, gradients and AdamW's two moments in
    fp32 (sharded over the ranks as :func:`training_state_bytes` says), the logits and
    their gradient for one micro-batch, and the process itself. On the CPU every local
    rank shares this machine's memory; on GPUs each rank needs it on its own device.

    Raises:
        UsageError: with the estimate and what is available.
    """
    n = sum(p.numel() for p in shape_model(settings.model).parameters())
    micro = max(1, settings.batch_size // max(1, world_size) // max(1, settings.grad_accum))
    logits = 2 * 4 * micro * settings.model.context_length * settings.model.vocab_size
    per_rank = training_state_bytes(n, settings.sharding, world_size,
                                    getattr(settings, "reshard_after_forward", True)) + logits
    what = (f"{n:,} parameters: weights, gradients and AdamW state in fp32 (sharded as "
            f"--sharding {settings.sharding} shards them), and the logits of a micro-batch")
    hint = "make it smaller (--vocab-size, --d-model, --n-layers, --batch-size)"
    if device_type == "cuda":
        try:
            import torch

            smallest = min(torch.cuda.get_device_properties(i).total_memory
                           for i in range(min(world_size, torch.cuda.device_count())))
        except Exception:  # noqa: BLE001 (no answer from the driver: nothing to check)
            return
        if per_rank > smallest:
            raise UsageError(f"the model needs at least {_fmt(per_rank)} per GPU ({what}); "
                             f"the GPUs have {_fmt(smallest)}: {hint}")
        return
    need = world_size * (per_rank + PROCESS_BYTES)
    have = available if available is not None else available_memory()
    if have is not None and need > have:
        raise UsageError(f"the run needs at least {_fmt(need)} of memory ({what}, "
                         f"{world_size} rank(s)); this machine has {_fmt(have)} available: "
                         f"{hint}")


def check_checkpoint_fits(ckpt: dict[str, Any], settings: Any, path: Any) -> None:
    """A checkpoint's tensors, random state and position fit the run about to start.

    Raises:
        UsageError: one line naming the checkpoint and the first thing that does not fit.
    """
    import torch

    from lab2_trainer.parallel import param_groups

    model = shape_model(settings.model)
    expected = model.state_dict()
    saved = ckpt["model"]
    if not isinstance(saved, dict):
        raise UsageError(f"checkpoint {path}: its model is not a state dict")
    for name in expected:
        if name not in saved:
            raise UsageError(f"checkpoint {path}: the model lacks {name}")
        t = saved[name]
        if not isinstance(t, torch.Tensor) or t.shape != expected[name].shape:
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise UsageError(f"checkpoint {path}: model tensor {name} is {got}, the model "
                             f"needs {list(expected[name].shape)}")
    extra = sorted(set(saved) - set(expected))
    if extra:
        raise UsageError(f"checkpoint {path}: the model has no tensor {extra[0]}")
    from zero1.checkpoint import check_state_dict, dry_run_load

    opt = torch.optim.AdamW(param_groups(model, settings.weight_decay), lr=settings.lr,
                            betas=(settings.beta1, settings.beta2), eps=1e-8)
    try:
        check_state_dict(ckpt["optimizer"], opt.param_groups, opt.defaults,
                         optimizer_name="AdamW", optimizer_cls=torch.optim.AdamW,
                         who="optimizer state")
        dry_run_load(ckpt["optimizer"], opt.param_groups, opt.defaults, torch.optim.AdamW,
                     who="optimizer state")
    except (TypeError, ValueError) as exc:
        raise UsageError(f"checkpoint {path}: {exc}") from None
    _check_rng(ckpt["rng"], path)
    sampler = ckpt["sampler"]
    if not isinstance(sampler, dict) or not all(
            isinstance(sampler.get(k), int) and sampler[k] >= 0 for k in ("seed", "draws")):
        raise UsageError(f"checkpoint {path}: its sampler position is not two integers >= 0")
    if sampler["seed"] != settings.seed:
        raise UsageError(f"checkpoint {path} draws its data with seed {sampler['seed']}, not "
                         f"--seed {settings.seed}")
    step = ckpt["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise UsageError(f"checkpoint {path}: its step {step!r} is not an integer >= 0")


def _check_rng(rng: Any, path: Any) -> None:
    """Try the saved CPU random state for real (and put ours back); the GPU one must at
    least be a byte tensor."""
    import torch

    if not isinstance(rng, dict) or not isinstance(rng.get("cpu"), torch.Tensor):
        raise UsageError(f"checkpoint {path}: its random state is not a dict with a 'cpu' "
                         "tensor")
    ours = torch.get_rng_state()
    try:
        torch.set_rng_state(rng["cpu"])
    except (RuntimeError, TypeError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"checkpoint {path}: its CPU random state is unusable: {reason}") \
            from None
    finally:
        torch.set_rng_state(ours)
    cuda = rng.get("cuda")
    if cuda is not None and not (isinstance(cuda, torch.Tensor) and cuda.dtype == torch.uint8
                                 and cuda.dim() == 1):
        raise UsageError(f"checkpoint {path}: its GPU random state is not a byte tensor")
