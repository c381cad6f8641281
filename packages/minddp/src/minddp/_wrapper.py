"""What both overlapping wrappers share: construction checks, forward, no_sync, hooks."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from minddp._group import group_size, require_initialized
from minddp.averaging import Averager
from minddp.broadcast import broadcast_module
from minddp.model_check import check_model_consistency
from minddp.stats import SyncStats


class DataParallelWrapper(nn.Module):
    """Base class: holds ``.module``, syncs it at construction, owns the hook plumbing.

    Subclasses implement ``_on_grad_ready(index)`` (called by each parameter's
    post-accumulate-grad hook), ``_before_forward()`` and
    ``finish_gradient_synchronization()``.
    """

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        require_initialized()
        self.module = module
        self.process_group = process_group
        self.world_size = group_size(process_group)
        # Compare first: broadcasting into a mismatched model would hang or corrupt.
        check_model_consistency(module, process_group=process_group)
        broadcast_module(module, 0, process_group=process_group)
        self._averager = Averager(process_group)
        self._sync_enabled = True
        self._hook_handles: list[Any] = []
        self.last_sync_stats = SyncStats()

    def _register_grad_hooks(self, params: list[nn.Parameter]) -> None:
        # The hook holds the wrapper weakly: a discarded wrapper must not keep
        # launching collectives from a module the user still trains.
        this = weakref.ref(self)
        for index, p in enumerate(params):

            def hook(_param: torch.Tensor, index: int = index) -> None:
                wrapper = this()
                if wrapper is not None:
                    wrapper._on_grad_ready(index)

            self._hook_handles.append(p.register_post_accumulate_grad_hook(hook))

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the wrapped module's parameters."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()

    def _on_grad_ready(self, index: int) -> None:
        raise NotImplementedError

    def _before_forward(self) -> None:
        """Hook for subclasses, run before every forward."""

    def finish_gradient_synchronization(self) -> None:
        raise NotImplementedError

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module's forward with every argument unchanged."""
        self._before_forward()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip communication for the backward passes run inside this context.

        Gradients accumulate locally; the next backward outside the context,
        followed by ``finish_gradient_synchronization()``, averages the accumulated
        sum. ``finish_gradient_synchronization()`` called inside the context does
        nothing.
        """
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def _unfinished_error(self) -> RuntimeError:
        return RuntimeError(
            f"{type(self).__name__}: a backward pass ran since the last "
            "finish_gradient_synchronization(); call it (on every rank) after each "
            "synchronized backward and before the next forward, or run accumulation "
            "steps inside no_sync()"
        )
