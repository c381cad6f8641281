"""The two baselines: average gradients after backward, per parameter or all at once."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from minddp.comm import group_size
from minddp.flat import group_by_dtype_device
from minddp.model_check import check_signature_agrees, gradient_signature, trainable_parameters


@torch.no_grad()
def all_reduce_gradients(
    module: nn.Module, *, flat: bool = False, process_group: dist.ProcessGroup | None = None,
    check: bool = True,
) -> None:
    """Average the gradients of ``module``'s trainable parameters over all ranks.

    Call it after ``backward()`` and before ``optimizer.step()``, on every rank.

    A parameter whose ``.grad`` is None on this rank (unused in this step's graph)
    counts as zeros, so ranks never disagree about which collectives to run. A
    parameter that got no gradient on *any* rank keeps ``.grad = None``, exactly as
    single-process training would leave it (an optimizer then skips it). To learn
    which is which, the ranks also sum one "used" flag per parameter.

    Args:
        module: the model (the same on every rank).
        flat: False: one all-reduce per parameter (plus one for the used flags).
            True: per dtype/device, all gradients and their used flags are packed into
            one flat buffer and reduced with one all-reduce.
        process_group: the group to average over (default group when None).
        check: first compare the trainable parameters' names, shapes and dtypes across
            ranks (one all-reduce of two int64 words); on by default, since reducing
            gradients of different shapes corrupts them or aborts the process.

    Raises:
        ModelMismatchError: on every rank, when the ranks' trainable parameters differ;
            no gradient is touched.
    """
    params = [p for _, p in trainable_parameters(module)]
    world = group_size(process_group)
    if check and world > 1:
        check_signature_agrees(gradient_signature(module), what="trainable parameters",
                               process_group=process_group,
                               device=params[0].device if params else None)
    if not params:
        return
    if flat:
        _flat(params, world, process_group)
    else:
        _per_parameter(params, world, process_group)


def _per_parameter(params: list[nn.Parameter], world: int, group) -> None:
    used = torch.tensor(
        [p.grad is not None for p in params], dtype=torch.float32, device=params[0].device
    )
    dist.all_reduce(used, group=group)
    handles = []
    reduced = []
    for p, used_somewhere in zip(params, used.tolist()):
        if not used_somewhere:
            continue  # no rank has a gradient: leave it None everywhere, send nothing
        if p.grad is None:
            p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        elif not p.grad.is_contiguous():
            p.grad = p.grad.contiguous()
        handles.append(dist.all_reduce(p.grad, group=group, async_op=True))
        reduced.append(p.grad)
    for handle, grad in zip(handles, reduced):
        handle.wait()
        grad.div_(world)


def _flat(params: list[nn.Parameter], world: int, group) -> None:
    pending = []
    for indices in group_by_dtype_device(params):
        members = [params[i] for i in indices]
        ref = members[0]
        pieces = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in members
        ]
        # The used flags ride at the end of the same buffer: no extra collective.
        flags = torch.tensor(
            [p.grad is not None for p in members], dtype=ref.dtype, device=ref.device
        )
        buffer = torch.cat([*pieces, flags])
        pending.append((dist.all_reduce(buffer, group=group, async_op=True), buffer, members))
    for handle, buffer, members in pending:
        handle.wait()
        buffer.div_(world)
        numel = sum(p.numel() for p in members)
        used = buffer[numel:].tolist()
        offset = 0
        for p, used_somewhere in zip(members, used):
            n = p.numel()
            if used_somewhere > 0:
                reduced = buffer[offset : offset + n].view_as(p)
                if p.grad is None:
                    p.grad = reduced.clone()
                else:
                    p.grad.copy_(reduced)
            offset += n
