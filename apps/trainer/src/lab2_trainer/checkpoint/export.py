"""``lab2-train export``: a step folder (:mod:`lab2_trainer.checkpoint.folders`) turned into one
single-file checkpoint (:mod:`lab2_trainer.checkpoint.single_file`): a plain ``torch.load``
holding the model's state dict and AdamW's own state dict (with ``--optimizer muon``, AdamW's
groups then Muon's in one state dict, as the run's optimizer saves it), which ``--resume``
also takes and any tp-1 model loads. The step folder is verified against its manifest
first, and nothing is gathered across processes: one process reads every rank's parts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from lab2_trainer.checkpoint.folders import (
    MANIFEST,
    STEP_FOLDER,
    load_trainer_state,
    non_finite,
    resolve,
    verify,
)
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
        UsageError: the output cannot be written there (checked first: a FIFO, a folder,
            a path below a file, a name too long, a place inside a checkpoint), or the
            source is not a complete, intact checkpoint with finite values (the checks of
            ``--resume``).
    """
    from lab2_trainer.checkpoint.parts import (
        COUNTS,
        MOMENTS,
        MUON_STATE,
        model_key,
        parameter_names,
        state_key,
    )
    from lab2_trainer.checkpoint.single_file import FORMAT as FILE_FORMAT
    from lab2_trainer.checkpoint.single_file import VERSION as FILE_VERSION
    from lab2_trainer.checkpoint.single_file import save_atomic
    from lab2_trainer.config import ModelConfig
    from lab2_trainer.models.transformer import shape_model

    folder = resolve(source)
    if folder.is_file():
        raise UsageError(f"{folder} is a single-file checkpoint already")
    check_export_output(out, folder)
    verify(folder)
    small = load_trainer_state(folder)
    model = shape_model(ModelConfig.from_dict(small["model_config"]))
    names = parameter_names(model)
    meta = saved_tensors(folder)
    keys = [model_key(n) for n in names.values()]
    keys += [k for n in names.values() for k in
             [state_key(n, what) for what in (*MOMENTS, *MUON_STATE, *COUNTS)] if k in meta]
    # Each whole (a checkpoint of manifest version 1 holds them flat: viewed in shape).
    whole = full_tensors(folder, keys)
    bad = non_finite(whole)  # what --resume refuses is not exported either
    if bad:
        raise UsageError(f"checkpoint {folder} is unusable: {bad}")
    params = dict(model.named_parameters(remove_duplicate=False))
    model_state = {name: whole[model_key(names[id(p)])].view(p.shape)
                   for name, p in params.items()}
    state = {}
    order = [p for g in small["optimizer_groups"] for p in g["params"]]
    settings = small["settings"]
    by_number = dict(zip(order, _optimizer_order(model, settings.get("weight_decay", 0.0),
                                                 settings.get("optimizer", "adamw"))))
    for number, p in by_number.items():
        name = names[id(p)]
        entry = {what: whole[state_key(name, what)].view(p.shape)
                 for what in (*MOMENTS, *MUON_STATE) if state_key(name, what) in whole}
        entry.update({what: whole[state_key(name, what)].reshape(()) for what in COUNTS
                      if state_key(name, what) in whole})
        if entry:
            state[number] = entry
    body = {k: v for k, v in small.items() if k not in ("format", "version", "checksums",
                                                       "optimizer_groups", "sharded")}
    save_atomic({"format": FILE_FORMAT, "version": FILE_VERSION, **body,
                 "model": model_state,
                 "optimizer": {"state": state, "param_groups": small["optimizer_groups"]}},
                out)
    return folder


def _optimizer_order(model: torch.nn.Module, decay: float,
                     optimizer: str = "adamw") -> list[torch.Tensor]:
    """The parameters in the run's optimizer's order (``parallel.optimizers``: AdamW's
    groups, and with ``--optimizer muon`` Muon's after them)."""
    from lab2_trainer.parallel.optimizers import optimizer_order

    return optimizer_order(model, decay, optimizer)


def keyed_state(model: torch.nn.Module, optimizer_state: dict[str, Any],
                weight_decay: float, optimizer: str = "adamw") -> dict[str, torch.Tensor]:
    """A single-file checkpoint's optimizer state (parameters numbered in the trainer's
    order, as :func:`export` writes it; ``optimizer``: the run's ``--optimizer``) keyed as
    a step folder's tensors are, ``optim.<name>.<state>``, each whole: what a rank of a
    tensor-parallel run takes its part of
    (:func:`lab2_trainer.checkpoint.parts.load_whole`). ``model`` is the run's, cut or not
    (its parameters come in the same order and under the same names)."""
    from lab2_trainer.checkpoint.parts import (
        COUNTS,
        MOMENTS,
        MUON_STATE,
        parameter_names,
        state_key,
    )

    names = parameter_names(model)
    numbers = [n for g in optimizer_state["param_groups"] for n in g["params"]]
    out = {}
    for number, p in zip(numbers, _optimizer_order(model, weight_decay, optimizer)):
        for what, value in (optimizer_state["state"].get(number) or {}).items():
            if what in (*MOMENTS, *MUON_STATE, *COUNTS):
                out[state_key(names[id(p)], what)] = torch.as_tensor(value)
    return out


def check_export_output(out: str | os.PathLike, folder: Path) -> Path:
    """The export's output is a file that can be written (``--out``'s checks of a path:
    absent or a regular file, below a writable folder, a name the system takes) and lies
    outside every step folder, the source's above all (writing there would change a
    checkpoint).

    Raises:
        UsageError: one line naming what is wrong; nothing was written.
    """
    from lab2_trainer.runtime.paths import check_output_file, shown

    text = os.fspath(out)
    if text.endswith(("/", os.sep)) or text.endswith((f"{os.sep}.", f"{os.sep}..")) \
            or text in (".", ".."):
        raise UsageError(f"export output {shown(text)} names a folder; export writes one "
                         "file: name it (nothing was written)")
    check_output_file(text, "export output", make_parents=True)
    real = Path(os.path.realpath(Path(text).expanduser()))
    inside = [a for a in real.parents
              if a == Path(os.path.realpath(folder))
              or (STEP_FOLDER.match(a.name) and os.path.lexists(a / MANIFEST))]
    if inside:
        raise UsageError(f"export output {shown(text)} is inside the checkpoint "
                         f"{shown(inside[0])}: writing there would change it; choose a path "
                         "outside (nothing was written)")
    return real


def write_export(source: str, out: str) -> int:
    """``lab2-train export CKPT OUT``'s work; returns the exit code (1, with one line, when
    the machine refuses a read or the write: the output is written atomically, so nothing
    is left of it)."""
    import sys

    try:
        folder = export(source, out)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"lab2-train: error: export failed: {exc.strerror or exc}{where}; nothing was "
              "written", file=sys.stderr, flush=True)
        return 1
    print(f"lab2-train: exported {folder} to {out}")
    return 0


def copy_bytes_atomic(data: bytes, path: Path) -> None:
    atomic_write(path, lambda f: f.write(data))
