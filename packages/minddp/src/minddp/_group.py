"""Process-group helpers shared by every variant."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn


def require_initialized() -> None:
    """Raise a clear error when torch.distributed has no default process group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "minddp needs an initialized process group: call "
            "torch.distributed.init_process_group(...) before using it"
        )


def group_size(process_group: dist.ProcessGroup | None) -> int:
    """World size of ``process_group`` (the default group when None)."""
    require_initialized()
    return dist.get_world_size(group=process_group)


def group_rank(process_group: dist.ProcessGroup | None) -> int:
    """This process's rank inside ``process_group`` (the default group when None)."""
    require_initialized()
    return dist.get_rank(group=process_group)


def global_rank_of(process_group: dist.ProcessGroup | None, rank_in_group: int) -> int:
    """Translate a rank inside ``process_group`` to the global rank collectives expect."""
    if process_group is None or process_group is dist.GroupMember.WORLD:
        return rank_in_group
    get = getattr(dist, "get_global_rank", None) or dist.distributed_c10d._get_global_rank
    return get(process_group, rank_in_group)


def trainable_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters that take part in gradient averaging, in registration order.

    ``named_parameters`` already yields a tied (shared) parameter once, under its
    first name, so each is reduced once. Frozen parameters (``requires_grad=False``)
    get no gradient and are left out.
    """
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]
