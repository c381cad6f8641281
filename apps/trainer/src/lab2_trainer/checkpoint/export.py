"""``lab2-train export``: a step folder (:mod:`lab2_trainer.checkpoint.folders`) turned into one
single-file checkpoint (:mod:`lab2_trainer.checkpoint.single_file`): a plain ``torch.load``
holding the model's state dict and AdamW's own state dict, which ``--resume`` also takes and
any tp-1 model loads. The step folder is verified against its manifest first, and nothing is
gathered across processes: one process reads every rank's parts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from lab2_trainer.checkpoint.folders import load_trainer_state, resolve, verify
from lab2_trainer.checkpoint.parts import full_tensors, saved_tensors
from lab2_trainer.config import UsageError
from lab2_trainer.runtime.run_folder import atomic_write


def export(source: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write a step folder (or the newest of a run) as one single-file checkpoint: the
    model's state dict and AdamW's own state dict (parameters numbered in the optimizer's
    order), with the run's settings, position and random state, which ``--resume`` takes.

    Returns:
        The step folder exported.

    Raises:
        UsageError: the source is not a complete, intact checkpoint.
    """
    from lab2_trainer.checkpoint.parts import MOMENTS, model_key, parameter_names, state_key
    from lab2_trainer.checkpoint.single_file import FORMAT as FILE_FORMAT
    from lab2_trainer.checkpoint.single_file import VERSION as FILE_VERSION
    from lab2_trainer.checkpoint.single_file import save_atomic
    from lab2_trainer.config import ModelConfig
    from lab2_trainer.models.transformer import shape_model

    folder = resolve(source)
    if folder.is_file():
        raise UsageError(f"{folder} is a single-file checkpoint already")
    verify(folder)
    small = load_trainer_state(folder)
    model = shape_model(ModelConfig.from_dict(small["model_config"]))
    names = parameter_names(model)
    meta = saved_tensors(folder)
    keys = [model_key(n) for n in names.values()]
    keys += [k for n in names.values() for k in
             [state_key(n, m) for m in (*MOMENTS, "step")] if k in meta]
    flat = full_tensors(folder, keys)
    params = dict(model.named_parameters(remove_duplicate=False))
    model_state = {name: flat[model_key(names[id(p)])].view(p.shape)
                   for name, p in params.items()}
    state = {}
    order = [p for g in small["optimizer_groups"] for p in g["params"]]
    by_number = dict(zip(order, _optimizer_order(model, small)))
    for number, p in by_number.items():
        name = names[id(p)]
        if state_key(name, "exp_avg") in flat:
            state[number] = {**{m: flat[state_key(name, m)].view(p.shape) for m in MOMENTS},
                             "step": flat[state_key(name, "step")].reshape(())}
    body = {k: v for k, v in small.items() if k not in ("format", "version", "checksums",
                                                       "optimizer_groups", "sharded")}
    save_atomic({"format": FILE_FORMAT, "version": FILE_VERSION, **body,
                 "model": model_state,
                 "optimizer": {"state": state, "param_groups": small["optimizer_groups"]}},
                out)
    return folder


def _optimizer_order(model: torch.nn.Module, small: dict[str, Any]) -> list[torch.Tensor]:
    """The parameters in the trainer's AdamW order (``parallel.param_groups``)."""
    from lab2_trainer.parallel.parallelize import param_groups

    decay = small["settings"].get("weight_decay", 0.0)
    return [p for g in param_groups(model, decay) for p in g["params"]]


def write_export(source: str, out: str) -> int:
    """``lab2-train export CKPT OUT``'s work; returns the exit code."""
    if Path(out).is_dir():
        raise UsageError(f"{out} is a folder; export writes one file")
    folder = export(source, out)
    print(f"lab2-train: exported {folder} to {out}")
    return 0


def copy_bytes_atomic(data: bytes, path: Path) -> None:
    atomic_write(path, lambda f: f.write(data))
