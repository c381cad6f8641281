"""Check, before anything else talks over the wire, that every rank holds the same model.

Different parameter lists on different ranks would make the ranks issue
different collectives: best case a hang until the process group's timeout,
worst case silently averaged garbage. So every wrapper compares model
signatures first and fails loudly, on every rank, naming the first difference.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn

from minddp.comm import group_size

Entry = tuple[str, str, tuple[int, ...], str, bool]


class ModelMismatchError(RuntimeError):
    """Ranks hold models that differ in parameter/buffer names, shapes, dtypes or
    ``requires_grad`` flags."""


def model_signature(module: nn.Module) -> list[Entry]:
    """The facts that must agree across ranks, in registration order.

    Returns:
        One ``(kind, name, shape, dtype, requires_grad)`` entry per unique parameter
        (kind ``"param"``) and buffer (kind ``"buffer"``, requires_grad False).
    """
    sig: list[Entry] = [
        ("param", name, tuple(p.shape), str(p.dtype), p.requires_grad)
        for name, p in module.named_parameters()
    ]
    sig += [
        ("buffer", name, tuple(b.shape), str(b.dtype), False)
        for name, b in module.named_buffers()
    ]
    return sig


def _describe(entry: Entry | None) -> str:
    if entry is None:
        return "nothing (the list ended)"
    kind, name, shape, dtype, requires_grad = entry
    frozen = "" if kind == "buffer" else f", requires_grad={requires_grad}"
    return f"{kind} {name!r} shape={list(shape)} dtype={dtype}{frozen}"


def first_mismatch(reference: list[Entry], other: list[Entry]) -> str | None:
    """Describe the first position where two signatures differ, or None if equal."""
    for i in range(max(len(reference), len(other))):
        a = reference[i] if i < len(reference) else None
        b = other[i] if i < len(other) else None
        if a != b:
            return f"entry {i}: {_describe(a)} vs {_describe(b)}"
    return None


def _digest(sig: list[Entry]) -> str:
    return hashlib.sha256(repr(sig).encode()).hexdigest()


def check_model_consistency(
    module: nn.Module, *, process_group: dist.ProcessGroup | None = None
) -> None:
    """Raise :class:`ModelMismatchError` on every rank unless all ranks' models agree.

    Two rounds: first a short digest per rank (cheap for large models); only when
    digests differ, the full signatures, to name the first difference. Every rank
    sees the same gathered data, so every rank takes the same branch and raises the
    same error; none is left waiting in a collective.

    Args:
        module: the model this rank holds.
        process_group: the group to compare across (default group when None).
    """
    world = group_size(process_group)
    if world == 1:
        return
    sig = model_signature(module)
    digests: list[str | None] = [None] * world
    dist.all_gather_object(digests, _digest(sig), group=process_group)
    if all(d == digests[0] for d in digests):
        return
    _raise_first_difference(sig, world, process_group, "model")


def _raise_first_difference(sig: list[Entry], world: int, process_group, what: str) -> None:
    sigs: list[list[Entry] | None] = [None] * world
    dist.all_gather_object(sigs, sig, group=process_group)
    for rank in range(1, world):
        diff = first_mismatch(sigs[0], sigs[rank])  # type: ignore[arg-type]
        if diff is not None:
            raise ModelMismatchError(
                f"{what} differs between rank 0 and rank {rank} of {world}: {diff}. "
                "Every rank must build the same model (same parameters, buffers, "
                "shapes, dtypes and frozen flags) before wrapping it."
            )
    raise ModelMismatchError(f"{what} signatures differ across ranks")  # digest clash


def trainable_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters that take part in gradient averaging, in registration order.

    ``named_parameters`` already yields a tied (shared) parameter once, under its
    first name, so each is reduced once. Frozen parameters (``requires_grad=False``)
    get no gradient and are left out.
    """
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


def gradient_signature(module: nn.Module) -> list[Entry]:
    """The entries of :func:`model_signature` that gradient averaging depends on: the
    trainable parameters (names, shapes, dtypes), in registration order."""
    return [e for e in model_signature(module) if e[0] == "param" and e[4]]


def _collective_device(process_group, tensors) -> torch.device:
    for t in tensors:
        return t.device
    if dist.get_backend(process_group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_signature_agrees(
    sig: list[Entry], *, what: str = "model", process_group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> None:
    """Raise :class:`ModelMismatchError` on every rank unless ``sig`` is the same on all.

    Cheap enough to run every step: one all-reduce of two int64 words (the maximum of
    the digests and of their negations: they agree exactly when max == min). Only when
    they differ are the full signatures gathered, to name the first difference.

    Args:
        sig: this rank's signature (:func:`model_signature` or a part of it).
        what: what the message calls it ("model", "gradients").
        process_group: the group to compare across (default group when None).
        device: where the two words go (the parameters' device; NCCL needs a GPU).
    """
    world = group_size(process_group)
    if world == 1:
        return
    h = int.from_bytes(hashlib.sha256(repr(sig).encode()).digest()[:7], "little")
    device = device if device is not None else _collective_device(process_group, ())
    words = torch.tensor([h, -h], dtype=torch.int64, device=device)
    dist.all_reduce(words, op=dist.ReduceOp.MAX, group=process_group)
    if int(words[0]) == -int(words[1]):
        return
    _raise_first_difference(sig, world, process_group, what)
