"""Whether a checkpoint fits the run about to resume from it, checked before any rank starts:
its model tensors' names and shapes (against the model built on ``meta``), the optimizer's
state (zero1's checks, on ``meta`` tensors: AdamW's, and with ``--optimizer muon`` Muon's
part of it), the random state, the gradient scaler and the sampler's position. A mismatch
is one line naming the checkpoint and the first thing that does not fit
(:class:`lab2_trainer.config.UsageError`).

What reads what (step folders; their manifest's ``version``):

* manifest version 2 (this trainer's): every tensor stored in its whole shape, the shape it
  has at ``--tp 1``; written at any ``--tp``, read at any ``--tp``, world size and kind;
* manifest version 1 (trainer 0.12.0 and earlier): every tensor stored as its flat 1-D view;
  still read, at any ``--tp`` (each rank reads the ranges of the flat view that hold its
  boxes), and exported;
* a trainer of manifest version 1 refuses a version 2 step folder in one line, before any
  rank starts (its manifest's version);
* single-file checkpoints (``lab2-train export``'s, earlier runs' ``ckpt.pt``) hold the
  whole model and optimizer state in the ``--tp 1`` layout, and resume at any ``--tp``.
"""

from __future__ import annotations

import math
from typing import Any

from lab2_trainer.checkpoint.rng import KEY, check_saved, check_states
from lab2_trainer.config import INT_LIMIT, UsageError
from lab2_trainer.models.transformer import shape_model


def check_checkpoint_fits(ckpt: dict[str, Any], settings: Any, path: Any) -> None:
    """A checkpoint's tensors, random state and position fit the run about to start.

    Raises:
        UsageError: one line naming the checkpoint and the first thing that does not fit.
    """
    import torch

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
    _refuse_extra(saved, expected, path)
    from zero1.checkpoint import dry_run_load

    optimizers = _optimizers_like_the_run(model, settings)
    parts = _check_optimizer_state(ckpt["optimizer"], optimizers, path)
    try:
        for opt, part in zip(optimizers, parts):
            dry_run_load(part, opt.param_groups, opt.defaults, type(opt),
                         who="optimizer state")
    except (TypeError, ValueError) as exc:
        raise UsageError(f"checkpoint {path}: {exc}") from None
    _check_content(parts, optimizers, settings, path)
    _check_run_state(ckpt, settings, path, len(list(model.parameters())))


def check_sharded_checkpoint_fits(small: dict[str, Any], tensors: dict[str, Any],
                                  settings: Any, path: Any) -> None:
    """A sharded checkpoint (its ``trainer.pt`` and DCP's metadata, ``tensors``) fits the
    run about to start: every parameter's tensor of its whole shape (its flat view of as
    many elements in a checkpoint of manifest version 1, where every tensor is 1-D), the
    optimizer's state whole or absent for each, nothing else; then what
    :func:`check_checkpoint_fits` checks of the rest. No tensor is read.

    Raises:
        UsageError: one line naming the checkpoint and the first thing that does not fit.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from lab2_trainer.checkpoint.parts import (
        model_key,
        parameter_names,
        state_key,
        state_names,
    )

    model = shape_model(settings.model)
    names = parameter_names(model)
    optimizers = _optimizers_like_the_run(model, settings)
    # Each parameter's state names: those of the optimizer that steps it (AdamW's moments
    # and count; Muon's momentum buffer alone).
    kept = {id(p): state_names(opt) for opt in optimizers for g in opt.param_groups
            for p in g["params"]}
    stored = [tuple(md.size) for md in tensors.values()
              if isinstance(md, TensorStorageMetadata)]
    flat = all(len(size) == 1 for size in stored)  # manifest version 1
    sizes: dict[str, tuple[int, ...]] = {}
    for p in model.parameters():
        name = names[id(p)]
        shape = (p.numel(),) if flat else tuple(p.shape)
        sizes[model_key(name)] = shape
        moments, counts = kept.get(id(p), ((), ()))
        if any(state_key(name, what) in tensors for what in (*moments, *counts)):
            sizes.update({state_key(name, m): shape for m in moments})
            sizes.update({state_key(name, c): (1,) for c in counts})
    for key, shape in sizes.items():
        md = tensors.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise UsageError(f"checkpoint {path}: it lacks tensor {key}")
        if tuple(md.size) != shape or not md.properties.dtype.is_floating_point:
            raise UsageError(f"checkpoint {path}: tensor {key} is {md.properties.dtype} of "
                             f"shape {list(md.size)}; the model needs a floating tensor of "
                             f"shape {list(shape)}")
    _refuse_extra(tensors, sizes, path)
    groups = {"state": {}, "param_groups": small["optimizer_groups"]}
    parts = _check_optimizer_state(groups, optimizers, path)
    _check_content(parts, optimizers, settings, path)
    _check_run_state(small, settings, path, len(list(model.parameters())))


def _refuse_extra(saved: Any, expected: Any, path: Any) -> None:
    """A checkpoint tensor the model does not have is named, the first in sorted order."""
    extra = sorted(set(saved) - set(expected))
    if extra:
        raise UsageError(f"checkpoint {path}: the model has no tensor {extra[0]}")


def _optimizers_like_the_run(model: Any, settings: Any) -> list[Any]:
    """The run's optimizers over ``model`` (their groups and hyperparameters), for the
    checks, in the state dict's order: AdamW, and with ``--optimizer muon`` zero1's Muon."""
    import torch

    from lab2_trainer.parallel.optimizers import MuonSettings, muon_param_groups, param_groups

    adamw = dict(lr=settings.lr, betas=(settings.beta1, settings.beta2), eps=1e-8)
    if getattr(settings, "optimizer", "adamw") != "muon":
        return [torch.optim.AdamW(param_groups(model, settings.weight_decay), **adamw)]
    from zero1 import Muon

    adamw_groups, muon_groups = muon_param_groups(model, settings.weight_decay)
    return [torch.optim.AdamW(adamw_groups, **adamw),
            Muon(muon_groups, **MuonSettings(settings.muon_lr).kwargs())]


def _check_optimizer_state(state_dict: Any, optimizers: list[Any], path: Any) -> list[Any]:
    """zero1's structural checks of a state dict (its groups, ids, state tensors' shapes)
    against the run's optimizers, each against its own part of it (Muon's groups follow
    AdamW's); returns the parts.

    Raises:
        UsageError: one line naming the checkpoint and the first thing that does not fit.
    """
    from lab2_trainer.parallel.optimizers import split_state_dict
    from zero1.checkpoint import check_state_dict

    try:
        parts = ([state_dict] if len(optimizers) == 1 else
                 list(split_state_dict(state_dict, len(optimizers[0].param_groups))))
        for opt, part in zip(optimizers, parts):
            check_state_dict(part, opt.param_groups, opt.defaults,
                             optimizer_name=type(opt).__name__, optimizer_cls=type(opt),
                             who="optimizer state")
    except (TypeError, ValueError) as exc:
        raise UsageError(f"checkpoint {path}: {exc}") from None
    return parts


def _check_content(parts: list[Any], optimizers: list[Any], settings: Any, path: Any) -> None:
    """AdamW's part (:func:`_check_adamw_content`), then Muon's (:func:`_check_muon_content`)."""
    _check_adamw_content(parts[0], optimizers[0].param_groups, settings, path)
    if len(parts) > 1:
        _check_muon_content(parts[1], optimizers[1].param_groups, settings, path)


def _check_run_state(ckpt: dict[str, Any], settings: Any, path: Any, n_params: int) -> None:
    """The launch order, random state, scaler, data position and step of a checkpoint."""
    _check_gradient_order(ckpt.get("gradient_order"), n_params, path)
    check_states(ckpt["rng"], path)
    check_saved(ckpt.get(KEY), path)
    _check_scaler(ckpt.get("scaler"), path)
    sampler = ckpt["sampler"]
    if not isinstance(sampler, dict) or not all(
            _is_int(sampler.get(k)) and 0 <= sampler[k] < INT_LIMIT for k in ("seed", "draws")):
        raise UsageError(f"checkpoint {path}: its sampler position is not two integers >= 0")
    if sampler["seed"] != settings.seed:
        raise UsageError(f"checkpoint {path} draws its data with seed {sampler['seed']}, not "
                         f"--seed {settings.seed}")
    step = ckpt["step"]
    if not _is_int(step) or not 0 <= step < INT_LIMIT:
        raise UsageError(f"checkpoint {path}: its step {step!r} is not an integer >= 0")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    """A finite Python number (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


#: AdamW's per-parameter state, as ``torch.optim.AdamW`` keeps it (amsgrad off).
ADAMW_STATE = ("exp_avg", "exp_avg_sq", "step")


def _check_adamw_content(state_dict: dict[str, Any], groups: list[dict[str, Any]],
                         settings: Any, path: Any) -> None:
    """What zero1's structural checks leave to the optimizer's first step: each group's
    hyperparameters are AdamW's (``betas`` two numbers in [0, 1) equal to the run's, a
    finite ``lr``, ``eps`` and ``weight_decay``, no amsgrad nor maximize), and each
    parameter's state is exactly AdamW's: ``exp_avg`` and ``exp_avg_sq`` floating tensors
    of the parameter's shape and a finite ``step`` >= 0, or nothing (not stepped yet).

    Raises:
        UsageError: one line naming the group or parameter and what is wrong.
    """
    import torch

    betas = (settings.beta1, settings.beta2)
    decays = (settings.weight_decay, 0.0)  # parallel.param_groups: matrices, then vectors
    for i, saved in enumerate(state_dict["param_groups"]):
        where = f"checkpoint {path}: optimizer param group {i}"
        got = saved.get("betas")
        if (not isinstance(got, (list, tuple)) or len(got) != 2
                or not all(_is_real(b) and 0 <= b < 1 for b in got)):
            raise UsageError(f"{where}: betas must be two numbers in [0, 1), got {got!r}")
        if tuple(got) != betas:
            raise UsageError(f"{where}: betas {tuple(got)} differ from the run's (--beta1, "
                             f"--beta2) = {betas}")
        for key, low in (("lr", 0.0), ("eps", 0.0), ("weight_decay", 0.0)):
            value = saved.get(key)
            if not _is_real(value) or value < low or (key == "eps" and value == 0):
                raise UsageError(f"{where}: {key} must be a finite number "
                                 f"{'> 0' if key == 'eps' else '>= 0'}, got {value!r}")
        if i < len(decays) and saved["weight_decay"] != decays[i]:
            raise UsageError(f"{where}: weight_decay {saved['weight_decay']!r} differs from "
                             f"the run's {decays[i]!r}")
        for key in ("amsgrad", "maximize"):
            if saved.get(key, False) is not False:
                raise UsageError(f"{where}: {key}={saved[key]!r}; the trainer's AdamW runs "
                                 f"with {key}=False")
    for i, j, param, entry in _saved_entries(state_dict, groups):
        where = f"checkpoint {path}: optimizer state of parameter {j} in param group {i}"
        if set(entry) != set(ADAMW_STATE):
            raise UsageError(f"{where} holds {', '.join(sorted(map(str, entry)))}; AdamW's "
                             f"is {', '.join(sorted(ADAMW_STATE))}")
        for key in ("exp_avg", "exp_avg_sq"):
            t = entry[key]
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() \
                    or t.shape != param.shape:
                what = (f"a {t.dtype} tensor of shape {list(t.shape)}"
                        if isinstance(t, torch.Tensor) else f"a {type(t).__name__}")
                raise UsageError(f"{where}: {key} is {what}; it must be a floating tensor "
                                 f"of the parameter's shape {list(param.shape)}")
        step = entry["step"]
        if isinstance(step, torch.Tensor):
            step = step.item() if step.numel() == 1 and not step.is_complex() else None
        if not _is_real(step) or step < 0:
            raise UsageError(f"{where}: step must be one finite number >= 0, got "
                             f"{entry['step']!r}")


def _saved_entries(state_dict: dict[str, Any], groups: list[dict[str, Any]]):
    """Each saved per-parameter state beside the run's parameter: ``(group index, index in
    the group, parameter, saved entry)``, skipping parameters not stepped yet."""
    state = state_dict["state"]
    for i, (ours, saved) in enumerate(zip(groups, state_dict["param_groups"])):
        for j, (param, saved_id) in enumerate(zip(ours["params"], saved["params"])):
            entry = state.get(saved_id)
            if entry:
                yield i, j, param, entry

def _check_muon_content(state_dict: dict[str, Any], groups: list[dict[str, Any]],
                        settings: Any, path: Any) -> None:
    """Muon's part of the state: each group's momentum in [0, 1), a finite ``lr`` and the
    run's ``weight_decay``; each parameter's state exactly a floating ``momentum_buffer``
    of its shape, or nothing (not stepped yet).

    Raises:
        UsageError: one line naming the group or parameter and what is wrong.
    """
    import torch

    for i, saved in enumerate(state_dict["param_groups"]):
        where = f"checkpoint {path}: Muon's param group {i}"
        momentum, lr = saved.get("momentum"), saved.get("lr")
        if not (_is_real(momentum) and 0 <= momentum < 1):
            raise UsageError(f"{where}: momentum must be a number in [0, 1), got "
                             f"{momentum!r}")
        if not (_is_real(lr) and lr >= 0):
            raise UsageError(f"{where}: lr must be a finite number >= 0, got {lr!r}")
        if saved.get("weight_decay") != settings.weight_decay:
            raise UsageError(f"{where}: weight_decay {saved.get('weight_decay')!r} differs "
                             f"from the run's {settings.weight_decay!r}")
    for i, j, param, entry in _saved_entries(state_dict, groups):
        where = f"checkpoint {path}: Muon's state of parameter {j} in its group {i}"
        t = entry.get("momentum_buffer") if isinstance(entry, dict) else None
        if set(entry) != {"momentum_buffer"} or not isinstance(t, torch.Tensor) \
                or not t.is_floating_point() or t.shape != param.shape:
            raise UsageError(f"{where} must be a floating momentum_buffer of the "
                             f"parameter's shape {list(param.shape)} alone")


def _check_gradient_order(order: Any, count: int, path: Any) -> None:
    """minddp's learned launch order: None, or a permutation of the trainable parameters'
    indices (``range(count)``)."""
    if order is None:
        return
    if (not isinstance(order, (list, tuple)) or not all(_is_int(i) for i in order)
            or sorted(order) != list(range(count))):
        shown = repr(order) if len(repr(order)) <= 80 else repr(order)[:77] + "..."
        raise UsageError(f"checkpoint {path}: its gradient_order must be a permutation of "
                         f"range({count}) (the model's trainable parameters), got {shown}")


def _check_scaler(scaler: Any, path: Any) -> None:
    """fp16's GradScaler state: None or empty, or a dict of finite numbers with a scale > 0."""
    if not scaler:
        return
    if not isinstance(scaler, dict) or not all(_is_real(v) for v in scaler.values()) \
            or not scaler.get("scale", 1.0) > 0:
        raise UsageError(f"checkpoint {path}: its gradient scaler state is not a dict of "
                         "finite numbers with a scale > 0")
