"""The optimizer a run steps with (``--optimizer``): AdamW over every parameter, or Muon over
the blocks' matrices with AdamW over the rest (:mod:`lab2_trainer.recipe.muon` says which
and why), built by every sharding family through :func:`build`.

With Muon the run has two optimizers, each made by the family as it makes AdamW alone
(plain, zero1's ``ShardedOptimizer`` or ``Stage3Optimizer``, PyTorch's
``ZeroRedundancyOptimizer``): zero1's stages step each Muon matrix whole on one owner
rank, and the broadcasting kinds (zero1-allreduce, ZeroRedundancyOptimizer) give each rank
whole parameters anyway. The step sees the two as one, :class:`MuonWithAdamW`:

* ``param_groups``: AdamW's (the matrices that decay, here the LM head; then the vectors
  and tables), then Muon's (the blocks' matrices); the state dict numbers the parameters
  in that order, each entry in its own optimizer's format (AdamW's ``exp_avg``,
  ``exp_avg_sq`` and ``step``, Muon's ``momentum_buffer``), so a checkpoint is one plain
  state dict that :func:`split_state_dict` cuts back into the two;
* clipping takes the global norm over both (one process's ``clip_grad_norm_`` over every
  parameter) and scales both optimizers' averaged gradients by the same factor;
* ``set_lr`` gives AdamW the schedule's rate and Muon the same times ``--muon-lr / --lr``:
  one warm-up and cosine, two peaks.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lab2_trainer.recipe.muon import ADJUST_LR_FN, MOMENTUM, NESTEROV

#: Builds one optimizer of a family: ``make(groups, optimizer_cls, **hyperparameters)``.
Make = Callable[..., Any]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW's two groups over every trainable parameter: the matrices decay; vectors (norm
    weights, biases) and the embedding tables do not (the tables set the residual stream's
    scale: lab2_trainer.recipe.defaults)."""
    from minitp import VocabParallelEmbedding  # a table too, cut over tensor-parallel ranks

    tables = {id(m.weight) for m in model.modules()
              if isinstance(m, (nn.Embedding, VocabParallelEmbedding))}
    decay, no_decay = [], []
    for p in model.parameters():  # tied weights come once
        if p.requires_grad:
            (decay if p.dim() >= 2 and id(p) not in tables else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def muon_param_groups(model: nn.Module, weight_decay: float
                      ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(AdamW's groups, Muon's groups): Muon takes the trainable 2-D weights inside
    ``model.blocks``, decaying; AdamW keeps :func:`param_groups`' groups less those."""
    blocks = getattr(model, "blocks", nn.ModuleList())
    matrices = {id(p) for p in blocks.parameters() if p.dim() == 2 and p.requires_grad}
    decay, no_decay = param_groups(model, weight_decay)
    muon = [p for p in decay["params"] if id(p) in matrices]
    rest = [p for p in decay["params"] if id(p) not in matrices]
    return ([{**decay, "params": rest}, no_decay],
            [{"params": muon, "weight_decay": weight_decay}])


def optimizer_order(model: nn.Module, weight_decay: float, optimizer: str = "adamw"
                    ) -> list[torch.Tensor]:
    """The trainable parameters in the run's optimizer's numbering (its state dict's keys):
    :func:`param_groups`' order, or with Muon AdamW's groups then Muon's."""
    if optimizer == "muon":
        adamw, muon = muon_param_groups(model, weight_decay)
        groups = adamw + muon
    else:
        groups = param_groups(model, weight_decay)
    return [p for g in groups for p in g["params"]]


@dataclass(frozen=True)
class MuonSettings:
    """Muon's hyperparameters in a run (``zero1.Muon``'s arguments but the weight decay,
    which its group carries).

    Attributes:
        lr: the peak learning rate (``--muon-lr``); the schedule scales it as ``--lr``.
        momentum, nesterov, adjust_lr_fn: :mod:`lab2_trainer.recipe.muon`'s.
        ns_dtype: the dtype of the Newton-Schulz iteration (bfloat16, as torch.optim.Muon;
            None: the parameters' own, for float64 references).
    """

    lr: float
    momentum: float = MOMENTUM
    nesterov: bool = NESTEROV
    adjust_lr_fn: str | None = ADJUST_LR_FN
    ns_dtype: torch.dtype | None = torch.bfloat16

    def kwargs(self) -> dict[str, Any]:
        return dict(lr=self.lr, momentum=self.momentum, nesterov=self.nesterov,
                    adjust_lr_fn=self.adjust_lr_fn, ns_dtype=self.ns_dtype)


def muon_ns_dtype(device: torch.device) -> torch.dtype:
    """The dtype Muon's Newton-Schulz iteration runs in on ``device``: bfloat16 on CUDA
    (torch.optim.Muon's, on the tensor cores), float32 elsewhere. CPU runs are tests and
    demos, whose oracles compare layouts: in bfloat16 a gradient summed in another order
    can round another way (zero3 against one process drifted by 2e-4 in 6 steps), and the
    CPU orthogonalises no faster in it (a 384 × 128 matrix: 1.7 ms against 2.0 in float32)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def plain(groups: list[dict[str, Any]], optimizer_cls: type, **kwargs: Any) -> Any:
    """:data:`Make` of one process's (or a DDP wrapper's) optimizer: the class itself."""
    return optimizer_cls(groups, **kwargs)


def build(model: nn.Module, make: Make, *, weight_decay: float, adamw: dict[str, Any],
          muon: MuonSettings | None = None) -> Any:
    """The run's optimizer over ``model``, each optimizer in it made by ``make``: AdamW
    over :func:`param_groups`, or (``muon``) :class:`MuonWithAdamW` of AdamW over the rest
    and ``zero1.Muon`` over the blocks' matrices (made in that order on every rank).

    Args:
        adamw: AdamW's keyword arguments (lr, betas, eps, fused).
    """
    if muon is None:
        return make(param_groups(model, weight_decay), torch.optim.AdamW, **adamw)
    from zero1 import Muon

    adamw_groups, muon_groups = muon_param_groups(model, weight_decay)
    return MuonWithAdamW(make(adamw_groups, torch.optim.AdamW, **adamw),
                         make(muon_groups, Muon, **muon.kwargs()),
                         lr_ratio=muon.lr / adamw["lr"])


def split_state_dict(state_dict: dict[str, Any], adamw_groups: int
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
    """A :class:`MuonWithAdamW` state dict cut into AdamW's (its first ``adamw_groups``
    groups) and Muon's (the rest, renumbered from 0): each loadable by its own optimizer.

    Raises:
        ValueError: no group is left for Muon (an AdamW run's state dict).
    """
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"),
                                                          list):
        raise ValueError("the optimizer state is not a state dict with param_groups")
    groups, state = state_dict["param_groups"], state_dict.get("state", {})
    if len(groups) <= adamw_groups:
        raise ValueError(f"it has {len(groups)} parameter groups, AdamW's alone; Muon with "
                         f"AdamW has {adamw_groups} for AdamW and Muon's after them")
    first = {i for g in groups[:adamw_groups] for i in g["params"]}
    renumber = {old: new for new, old in
                enumerate(i for g in groups[adamw_groups:] for i in g["params"])}
    return ({"state": {i: v for i, v in state.items() if i in first},
             "param_groups": groups[:adamw_groups]},
            {"state": {renumber[i]: v for i, v in state.items() if i in renumber},
             "param_groups": [{**g, "params": [renumber[i] for i in g["params"]]}
                              for g in groups[adamw_groups:]]})


def _count(optimizer: Any) -> int:
    return sum(len(g["params"]) for g in optimizer.param_groups)


class MuonWithAdamW:
    """AdamW and Muon, each over its own parameters, stepped as one optimizer (see the
    module docstring). Every method that is a collective for the family's optimizers is one
    here: call it on every rank.

    Args:
        adamw, muon: the two optimizers, as the family made them.
        lr_ratio: Muon's peak learning rate over AdamW's (``set_lr`` keeps it).
    """

    def __init__(self, adamw: Any, muon: Any, *, lr_ratio: float) -> None:
        self.adamw, self.muon = adamw, muon
        self.optimizers = (adamw, muon)
        self.lr_ratio = lr_ratio

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """AdamW's groups, then Muon's (the dicts themselves: edits reach the optimizers)."""
        return [*self.adamw.param_groups, *self.muon.param_groups]

    @property
    def state(self) -> dict[Any, Any]:
        """Both optimizers' state on this rank (a merged copy of the two dicts)."""
        return {**self.adamw.state, **self.muon.state}

    def set_lr(self, lr: float) -> None:
        """AdamW's groups at ``lr`` (the schedule's), Muon's at ``lr`` × ``lr_ratio``."""
        for group in self.adamw.param_groups:
            group["lr"] = lr
        for group in self.muon.param_groups:
            group["lr"] = lr * self.lr_ratio

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step AdamW, then Muon (both before either's ``zero_grad``: under stage 3 that
        clears the model's gradient shards)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    # ---------------------------------------------------- the sharded families' methods
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for opt in self.optimizers:
                stack.enter_context(opt.no_sync())
            yield

    def finish_gradient_synchronization(self) -> None:
        for opt in self.optimizers:
            opt.finish_gradient_synchronization()

    def shard_gradients(self) -> list[torch.Tensor]:
        """The averaged gradients this rank holds, AdamW's then Muon's."""
        return [g for opt in self.optimizers for g in opt.shard_gradients()]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip both optimizers' averaged gradients by their joint global norm (as
        ``torch.nn.utils.clip_grad_norm_`` over every parameter); returns it. Each
        optimizer measures its own (``max_norm`` inf: a scalar all-reduce each), the two
        are combined, and one factor scales both."""
        norms = [opt.clip_grad_norm_(math.inf, norm_type) for opt in self.optimizers]
        norms = torch.stack([n.to(norms[0].dtype) for n in norms])
        total = norms.max() if norm_type == math.inf else torch.linalg.vector_norm(
            norms, norm_type)
        if math.isfinite(max_norm):
            coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
            for g in self.shard_gradients():
                g.mul_(coef.to(g.dtype))
        return total

    @property
    def gradient_order(self) -> list[int] | None:
        """Both optimizers' learned bucket orders in one list over the joint numbering:
        AdamW's, then Muon's shifted past AdamW's parameters (None where none is learned)."""
        orders = [opt.gradient_order for opt in self.optimizers]
        if any(order is None for order in orders):
            return None
        shift = _count(self.adamw)
        return [*orders[0], *(i + shift for i in orders[1])]

    def set_gradient_order(self, order: list[int] | None) -> None:
        """Follow a saved :attr:`gradient_order` (collective): each optimizer its part."""
        if order is None:
            for opt in self.optimizers:
                opt.set_gradient_order(None)
            return
        shift = _count(self.adamw)
        self.adamw.set_gradient_order([i for i in order if i < shift])
        self.muon.set_gradient_order([i - shift for i in order if i >= shift])

    def numbered_pieces(self) -> list[tuple[int, Any]]:
        """(joint parameter number, piece) of what this rank steps, AdamW's then Muon's."""
        shift = _count(self.adamw)
        return [*self.adamw.numbered_pieces(),
                *((i + shift, piece) for i, piece in self.muon.numbered_pieces())]

    # --------------------------------------------------------------------- state dicts
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather each sharded optimizer's state onto rank ``to`` (collective)."""
        for opt in self.optimizers:
            if hasattr(opt, "consolidate_state_dict"):
                opt.consolidate_state_dict(to=to)

    def state_dict(self) -> dict[str, Any]:
        """One plain state dict: AdamW's groups and state, then Muon's, numbered on."""
        adamw, muon = (opt.state_dict() for opt in self.optimizers)
        shift = _count(self.adamw)
        return {"state": {**adamw["state"],
                          **{i + shift: v for i, v in muon["state"].items()}},
                "param_groups": [*adamw["param_groups"],
                                 *({**g, "params": [i + shift for i in g["params"]]}
                                   for g in muon["param_groups"])]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` (at any world size, under any family that runs Muon);
        each optimizer checks its part (a part that does not fit raises ``ValueError``)."""
        adamw, muon = split_state_dict(state_dict, len(self.adamw.param_groups))
        self.adamw.load_state_dict(adamw)
        self.muon.load_state_dict(muon)
