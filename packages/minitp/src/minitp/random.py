"""Random numbers under tensor parallelism: the same draws where the ranks of a group hold
the same tensor, draws of its own on each rank where each holds a different part.

Dropout is where it matters. Its mask must be the same on every rank of the group for a
tensor they all hold whole (the residual stream without sequence parallelism, anything
replicated): different masks would make the "same" activations differ, and the parameters
held whole on every rank would drift apart. And it must differ from rank to rank for what
each holds a different part of (attention probabilities of its own heads, a feed-forward's
hidden slice, under sequence parallelism its slice of the residual stream): equal masks
there would drop the same positions of every part, a pattern one process never draws.

* **Replicated regions** draw from the default generators as usual. The ranks of a group
  must hold them in the same state: seed them alike on every rank of a group (a different
  seed for each data-parallel rank, so that those draw different masks) and draw alike.
  :func:`check_same_rng` verifies it, as a collective.
* **Sharded regions** draw inside ``with sharded_rng(group):``, where the default
  generators give this rank a stream of its own; :func:`sharded_dropout` is dropout there.

How :func:`sharded_rng` forks. It draws one number from the CPU's default generator (the
same draw on every rank of the group: their default streams stay in step), mixes this
rank's index into it, and seeds the default generator of ``device`` (the CPU's, or a
GPU's) with the result for the duration of the block; on exit it gets its state back, and
the CPU's stream is one draw further on every rank alike. It keeps no state of its own,
so:

* a run is reproducible from its seed, and a checkpoint of the default generators' states
  is all a resumed run needs;
* activation checkpointing recomputes the same masks: ``torch.utils.checkpoint`` restores
  the default generators (the CPU's and the inputs' device's) before it recomputes, so the
  fork draws the same number and seeds the same stream again.

Compilation. dynamo does not trace a generator's state (``get_state``, ``set_state`` and
``manual_seed`` break the graph or make it skip the frame), so :func:`sharded_rng` is for
eager code and refuses to run while ``torch.compile`` traces. Under compilation
:func:`sharded_dropout` instead draws the mask of the whole tensor (as if it were not cut
along ``dim``) from the default generator, the same on every rank, and keeps this rank's
part: traceable, and this rank's part of the mask ``F.dropout`` draws for the uncut tensor
from that stream. It costs ``tp`` times the random numbers, and a transient buffer of the
whole tensor's (inductor, torch 2.15, generates them all before it keeps the part).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minitp.mappings import Group, compiling, group_rank, group_size

#: 2**64 divided by the golden ratio: consecutive ranks land far apart in the seed space.
_SPREAD = 0x9E3779B97F4A7C15
_SEEDS = 2**63


def _device_generator(device: torch.device) -> torch.Generator:
    """The default generator of an accelerator device (``torch.cuda``'s, say)."""
    module = getattr(torch, device.type, None)
    generators = getattr(module, "default_generators", None)
    if generators is None:
        raise ValueError(f"minitp.random does not know the default generator of {device}")
    index = device.index if device.index is not None else module.current_device()
    return generators[index]


def _generator(device: torch.device | str | None) -> torch.Generator:
    """The default generator of ``device`` (None: the CPU's)."""
    if device is None or torch.device(device).type == "cpu":
        return torch.default_generator
    return _device_generator(torch.device(device))


def rank_seed(base: int, rank: int) -> int:
    """The seed of rank ``rank``'s stream forked from the shared draw ``base``."""
    return (base + (rank + 1) * _SPREAD) % _SEEDS


@contextlib.contextmanager
def sharded_rng(group: Group = None, device: torch.device | str | None = None
                ) -> Iterator[None]:
    """Inside the block the default generator of ``device`` draws a stream of this rank's
    own; on exit it is back where it was, and the CPU's one draw further on every rank of
    the group alike. A group of one rank draws from the default stream itself.

    Args:
        group: the tensor-parallel process group (None: the default group).
        device: whose default generator is forked: where the random tensors of the block
            are drawn (a CUDA tensor's dropout draws from its device's); None: the CPU.

    Raises:
        RuntimeError: under ``torch.compile`` (generator state cannot be traced: use
            :func:`sharded_dropout`, which compiles).
    """
    if compiling():
        raise RuntimeError("minitp.random.sharded_rng cannot run under torch.compile (it "
                           "sets generator states, which dynamo does not trace): use "
                           "sharded_dropout, which draws a traceable mask there")
    n = group_size(group)
    if n == 1:
        yield
        return
    generator = _generator(device)
    # The shared draw, on the host (no device synchronisation).
    base = int(torch.randint(0, _SEEDS - 1, (), generator=torch.default_generator))
    saved = generator.get_state()
    generator.manual_seed(rank_seed(base, group_rank(group)))
    try:
        yield
    finally:
        generator.set_state(saved)


def sharded_dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, *,
                    group: Group = None, dim: int) -> torch.Tensor:
    """``F.dropout(x, p, training)`` for ``x`` this rank's part of a tensor cut over the
    group along ``dim``: each rank drops positions of its own.

    Eager, ``F.dropout`` inside :func:`sharded_rng` (this rank's stream). Under
    ``torch.compile``, this rank's part of ``F.dropout`` of the whole tensor's shape (ones),
    drawn from the default generator like a replicated draw: one graph, no break. A group
    of one rank is ``F.dropout`` itself.

    Args:
        x: this rank's part, ``1 / tp`` of the whole along ``dim``.
        p: the probability of dropping an element, in ``[0, 1]``.
        training: dropout acts only while training (``x`` itself otherwise).
        group: the tensor-parallel process group (None: the default group).
        dim: the dimension the whole tensor is cut along (1 for the sequence of
            ``[B, T, d]``, the heads of ``[B, H, T, T]``).
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} is not a dimension of a {x.dim()}-d tensor")
    if not training or p == 0.0:
        return x
    n = group_size(group)
    if n == 1:
        return F.dropout(x, p, True)
    if compiling():
        dim = dim % x.dim()
        whole = list(x.shape)
        whole[dim] *= n
        # Kept as a boolean slice of its own: the whole mask is freed, the slice saved.
        keep = F.dropout(x.new_ones(whole), p, True).chunk(n, dim)[group_rank(group)] != 0
        return x * keep * (1.0 / (1.0 - p)) if p < 1.0 else x * keep
    with sharded_rng(group, x.device):
        return F.dropout(x, p, True)


def check_same_rng(group: Group = None, device: torch.device | str | None = None) -> None:
    """Check that every rank of the group holds its default generators (the CPU's, and
    ``device``'s when it is not the CPU) in the same state, as replicated regions need; a
    collective.

    Raises:
        RuntimeError: naming the ranks whose state differs from the group's first rank's.
    """
    n = group_size(group)
    if n == 1:
        return
    digest = hashlib.sha256(torch.default_generator.get_state().numpy().tobytes())
    if device is not None and torch.device(device).type != "cpu":
        digest.update(_generator(device).get_state().cpu().numpy().tobytes())
    every: list[str | None] = [None] * n
    dist.all_gather_object(every, digest.hexdigest(), group=group)
    differ = [r for r, d in enumerate(every) if d != every[0]]
    if differ:
        raise RuntimeError(f"the default random generators of ranks {differ} of the "
                           "tensor-parallel group differ from rank 0's: seed them alike on "
                           "every rank of a group (replicated dropout would draw different "
                           "masks there)")
