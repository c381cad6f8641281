"""Every rank's random generators in a checkpoint, and what a resume puts back.

Dropout draws its masks from the default generators: the CPU's, and the rank's GPU's. A run
seeds them per data-parallel index (:func:`lab2_trainer.parallel.mesh.random_seed`), so the
data-parallel ranks draw masks of their own and the ranks of one tensor-parallel group the
same ones. Nothing else a step draws keeps state of its own: minitp's sharded streams
(``--sequence-parallel``) are forked from the default generators for each draw
(``minitp.random.sharded_rng``), and the data sampler is counter-based (its position is the
checkpoint's ``sampler``).

**Saved.** Each save gathers every rank's states to rank 0
(:class:`~lab2_trainer.checkpoint.writer.Checkpointer`, on its own Gloo group, in the
background) into the small state's :data:`KEY`: ``{"world_size": W, "tp": T, "ranks":
[states of global rank 0, 1, ...]}``, each states a dict ``{"cpu": ..., "cuda": ...}`` (the
GPU's where the rank had one). ``rng`` beside it stays rank 0's alone, which earlier
trainers read.

**Restored** (:func:`restore`):

* the same world size and ``--tp`` as the save (so each global rank has the same
  data-parallel and tensor-parallel index): each rank takes its own states back, and the
  resumed run draws the masks of the uninterrupted one, bit for bit;
* another layout: no saved rank is this rank, so each rank's generators are seeded afresh
  from ``--seed``, the step and its data-parallel index (:func:`resume_seed`): different
  for each data-parallel index, alike over a tensor-parallel group, the same for the same
  resume. A note says so;
* a checkpoint of an earlier version holds rank 0's states only (``rng``): every rank takes
  them, as before (with ``--dropout`` above 0 on several data-parallel ranks a note says
  that those ranks then draw the same masks).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from lab2_trainer.config import UsageError

#: Where the small state (``trainer.pt``, a single-file checkpoint) keeps every rank's
#: generator states.
KEY = "rng_by_rank"


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's default generators' states: the CPU's, and ``device``'s on CUDA."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Put back what :func:`rng_state` saved (a GPU's state only where there is one)."""
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def by_rank(states: list[dict[str, torch.Tensor]], tp: int) -> dict[str, Any]:
    """The :data:`KEY` entry of a save by ``len(states)`` ranks at ``--tp`` ``tp``."""
    return {"world_size": len(states), "tp": tp, "ranks": list(states)}


def resume_seed(seed: int, step: int, dp_index: int) -> int:
    """The seed of the default generators of data-parallel index ``dp_index`` when a resume
    at step ``step`` cannot take the saved states back (another layout): a fixed function
    of the three (64 bits of a hash of them), unrelated to the seeds a run starts from."""
    text = f"lab2-trainer resume rng: seed {seed}, step {step}, dp index {dp_index}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def restore(ckpt: dict[str, Any], device: torch.device, *, rank: int, world_size: int,
            tp: int, dp_index: int, seed: int) -> str | None:
    """Set this rank's default generators from a checkpoint's small state ``ckpt``:
    its own saved states, fresh ones (another layout), or rank 0's (an earlier version's
    checkpoint); see the module's notes. Returns a note for the run to print where its
    generators are not those an uninterrupted run would hold (None otherwise)."""
    saved = ckpt.get(KEY)
    if saved is None:
        set_rng_state(ckpt["rng"], device)
        return None if world_size // tp == 1 else (
            "the checkpoint holds rank 0's random generator states only (it was saved by "
            "an earlier version): every rank takes them, so the data-parallel ranks draw "
            "the same dropout masks")
    if (saved["world_size"], saved["tp"]) == (world_size, tp):
        set_rng_state(saved["ranks"][rank], device)
        return None
    step = int(ckpt["step"])
    torch.manual_seed(resume_seed(seed, step, dp_index))
    return (f"the checkpoint's random generator states were saved by {saved['world_size']} "
            f"rank(s) at --tp {saved['tp']}, this run has {world_size} at --tp {tp}: each "
            f"rank's generators are seeded afresh from --seed {seed}, step {step} and its "
            "data-parallel index, so its dropout masks are not those of an uninterrupted run")


def check_saved(saved: Any, path: Any) -> None:
    """A checkpoint's :data:`KEY` entry is None (an earlier version's) or of the form
    :func:`by_rank` writes, with each rank's states usable (:func:`check_states`).

    Raises:
        UsageError: one line naming the checkpoint and what is wrong.
    """
    if saved is None:
        return
    if not isinstance(saved, dict) or not all(
            isinstance(saved.get(k), int) and not isinstance(saved.get(k), bool)
            and saved[k] >= 1 for k in ("world_size", "tp")):
        raise UsageError(f"checkpoint {path}: its {KEY} is not a dict with a world_size "
                         "and a tp of at least 1")
    ranks = saved.get("ranks")
    if not isinstance(ranks, list) or len(ranks) != saved["world_size"] \
            or saved["world_size"] % saved["tp"]:
        raise UsageError(f"checkpoint {path}: its {KEY} does not hold the random states of "
                         f"{saved['world_size']} rank(s) at tp {saved['tp']}")
    for n, states in enumerate(ranks):
        check_states(states, path, f"rank {n}'s ")


def check_states(rng: Any, path: Any, whose: str = "") -> None:
    """Try saved CPU generator states for real (and put ours back); a GPU's must at least
    be a byte tensor.

    Raises:
        UsageError: one line naming the checkpoint and what is wrong.
    """
    if not isinstance(rng, dict) or not isinstance(rng.get("cpu"), torch.Tensor):
        raise UsageError(f"checkpoint {path}: its {whose}random state is not a dict with a "
                         "'cpu' tensor")
    ours = torch.get_rng_state()
    try:
        torch.set_rng_state(rng["cpu"])
    except (RuntimeError, TypeError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"checkpoint {path}: its {whose}CPU random state is unusable: "
                         f"{reason}") from None
    finally:
        torch.set_rng_state(ours)
    cuda = rng.get("cuda")
    if cuda is not None and not (isinstance(cuda, torch.Tensor) and cuda.dtype == torch.uint8
                                 and cuda.dim() == 1):
        raise UsageError(f"checkpoint {path}: its {whose}GPU random state is not a byte tensor")
