"""The ranks' layout in the recipe: the sharding kinds and ``--ddp`` wrappers, which of them
work together, the default pair for a number of ranks, and what ``--tp`` can cut. No torch.

The ranks are a ``dp x tp`` grid, tensor-parallel ranks innermost; ``--sharding`` and
``--ddp`` act over the data-parallel ranks. The run's settings
(``lab2_trainer.config.TrainSettings``), the planner and the layer that lays a model over
the ranks (``lab2_trainer.parallel``) read these rules, so that they refuse alike. Muon's
own limits on the layout are :func:`lab2_trainer.recipe.muon.muon_problem`.
"""

from __future__ import annotations

from typing import Any

DDP_KINDS = ("bucketed", "individual", "flat", "naive", "torch", "none")
SHARDING_KINDS = ("none", "zero1", "zero2", "zero3", "zero1-allreduce", "torch", "fsdp")
#: The sharding kinds that average gradients themselves, with no DDP wrapper (``--ddp none``):
#: zero1 reduce-scattering them (ShardedOptimizer's stages 1 and 2, and stage 3) and
#: PyTorch's FSDP2.
SELF_REDUCING = ("zero1", "zero2", "zero3", "fsdp")


def data_parallel_ranks(world_size: int, tp: Any) -> int:
    """The data-parallel ranks among ``world_size``: ``world_size / tp`` (the world itself
    when ``tp`` is not a positive integer that divides it, for the checks to name)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or world_size % tp:
        return world_size
    return world_size // tp


def default_layout(world_size: int, sharding: str | None, ddp: str | None
                   ) -> tuple[str, str]:
    """(sharding, ddp) with the defaults filled for ``world_size`` ranks: zero1 with more
    than one rank (zero1-allreduce when a DDP wrapper is given), else none; the bucketed
    wrapper where the sharding takes one and there is more than one rank, else none."""
    if sharding is None:
        if world_size == 1:
            sharding = "none"
        else:  # --ddp X alone keeps the DDP-wrapper pairing
            sharding = "zero1-allreduce" if ddp not in (None, "none") else "zero1"
    if ddp is None:
        ddp = "bucketed" if world_size > 1 and sharding not in SELF_REDUCING else "none"
    return sharding, ddp


def layout_problem(sharding: str, ddp: str, precision: str, world_size: int,
                   dp: int) -> str | None:
    """What keeps ``sharding`` and the ``ddp`` wrapper from averaging the gradients of
    ``dp`` data-parallel ranks (of ``world_size``) in ``precision``, in one line naming the
    flags; None: nothing."""
    if sharding in SELF_REDUCING and ddp != "none":
        return (f"--sharding {sharding} averages gradients itself, without a DDP wrapper: "
                f"drop --ddp {ddp} (--sharding zero1-allreduce pairs a --ddp wrapper with "
                "zero1)")
    if sharding in SELF_REDUCING and precision == "fp16":
        return (f"--precision fp16 needs a gradient scaler that reads every averaged "
                f"gradient, which --sharding {sharding} does not leave on the model: use "
                "bf16")
    if sharding in ("zero1-allreduce", "torch") and ddp == "none" and dp > 1:
        return f"--sharding {sharding} needs a --ddp variant"
    if ddp == "none" and dp > 1 and sharding not in SELF_REDUCING:
        what = f"{dp} data-parallel ranks" if dp != world_size else f"{dp} ranks"
        return f"--ddp none cannot average gradients over {what}"
    return None


def tp_shape_problem(model: Any, tp: int, sequence_parallel: bool) -> str | None:
    """What keeps ``tp`` ranks from cutting ``model`` (a ``ModelConfig``) into equal parts
    (heads, feed-forward width, vocabulary; the sequence under sequence parallelism), in one
    line; None: nothing. The run's checks, the planner's and the cut itself all ask this."""
    if tp == 1:
        return ("--sequence-parallel splits the sequence over --tp ranks: give --tp > 1"
                if sequence_parallel else None)
    for name in ("n_heads", "d_ff", "vocab_size"):
        if getattr(model, name) % tp:
            return (f"--tp {tp} does not divide {_flag(name)} {getattr(model, name)}: each "
                    "tensor-parallel rank holds an equal part")
    if sequence_parallel and model.context_length % tp:
        return (f"--sequence-parallel needs --tp {tp} to divide --context-length "
                f"{model.context_length}")
    return None


def tp_problem(model: Any, tp: int, world_size: int, sequence_parallel: bool) -> str | None:
    """:func:`tp_shape_problem`, after whether ``tp`` divides the ``world_size`` ranks; one
    line, or None."""
    if tp > 1 and world_size % tp:
        return (f"--tp {tp} does not divide the {world_size} ranks (the ranks are "
                "data-parallel x tensor-parallel)")
    return tp_shape_problem(model, tp, sequence_parallel)


def _flag(name: str) -> str:
    # A model field's flag, as lab2_trainer.config.flag spells it (recipe imports no config).
    return "--" + name.replace("_", "-")
