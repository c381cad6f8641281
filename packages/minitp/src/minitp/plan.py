"""Shard an existing model in place, by a plan: which module gets which style.

A plan maps module-name patterns to styles::

    plan = {
        "embed": VocabEmbedding(),
        "layers.*.norm*": SequenceSplit(),
        "layers.*.attn": (SharedInput(), LocalHeads(("n_heads",))),
        "layers.*.attn.[qkv]_proj": ColwiseLinear(),
        "layers.*.attn.o_proj": RowwiseLinear(),
        "layers.*.mlp.up": ColwiseLinear(),
        "layers.*.mlp.down": RowwiseLinear(),
        "head": ColwiseLinear(),
    }
    parallelize(model, plan, group, sequence_parallel=True)

Patterns are ``fnmatch`` globs matched against the full names of
``model.named_modules()`` (``*`` matches dots too; ``[qkv]`` one character of a set). A
value is one style or a tuple of them.

Styles that **replace** a module (at most one per module):

* :class:`ColwiseLinear`: an ``nn.Linear`` becomes a :class:`ColumnParallelLinear`.
* :class:`RowwiseLinear`: an ``nn.Linear`` becomes a :class:`RowParallelLinear`.
* :class:`VocabEmbedding`: an ``nn.Embedding`` becomes a :class:`VocabParallelEmbedding`.

Styles that **adjust** a module:

* :class:`SharedInput`: the module's input enters the parallel region once (copied, or
  all-gathered along the sequence) for all the column layers inside it, which then skip
  their own. Without it, attention with separate q, k and v projections all-reduces its
  input gradient three times.
* :class:`LocalHeads`: divide integer attributes (``num_heads``...) by ``tp``, for
  attention code that reshapes by a head count: each rank has ``heads / tp`` of them.
* :class:`SequenceSplit`: under sequence parallelism the module runs on this rank's slice
  of the sequence (a norm); its parameters stay whole and their gradients are summed over
  the group. Without sequence parallelism it does nothing, so one plan serves both.

:func:`parallelize` checks the whole plan against the model first (:func:`check_plan`)
and refuses a bad one with a :class:`PlanError` naming the module, before changing
anything: a pattern that matches nothing, a module of the wrong type, sizes that do not
split into ``tp`` equal shards, a parameter shared with a module sharded another way.

Under sequence parallelism the tensors between blocks are ``[B, T/tp, d]``: the embedding
(a :class:`VocabEmbedding`) reduce-scatters into that layout, every column layer (or
:class:`SharedInput`) gathers the whole sequence, every row layer scatters it again. Each
module with parameters that runs on the slice needs :class:`SequenceSplit`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from minitp.layers import ColumnParallelLinear, RowParallelLinear, shard_size
from minitp.mappings import (
    Group,
    copy_to_region,
    gather_from_sequence,
    group_size,
    sum_gradient_over_group,
)
from minitp.vocab import VocabParallelEmbedding


class PlanError(ValueError):
    """A plan that cannot be applied to the model; the message names the module."""


# ------------------------------------------------------------------ the styles
@dataclass(frozen=True)
class ColwiseLinear:
    """Shard an ``nn.Linear``'s output features (see :class:`ColumnParallelLinear`).

    Attributes:
        gather_output: all-gather the output features (every rank gets the whole output).
        multiple_of: each shard must hold whole units of this many features (a head's
            ``head_dim``); a fused projection must be laid out so that consecutive rows
            are whole units (per head: its q, k and v rows together).
        overlap_grad_reduce: overlap the input-gradient collective with the weight
            gradient in backward.
    """

    gather_output: bool = False
    multiple_of: int = 1
    overlap_grad_reduce: bool = True


@dataclass(frozen=True)
class RowwiseLinear:
    """Shard an ``nn.Linear``'s input features (see :class:`RowParallelLinear`).

    Attributes:
        input_is_parallel: the input is already sharded (a column layer's output).
        multiple_of: each shard must hold whole units of this many features.
    """

    input_is_parallel: bool = True
    multiple_of: int = 1


@dataclass(frozen=True)
class VocabEmbedding:
    """Shard an ``nn.Embedding``'s rows (see :class:`VocabParallelEmbedding`)."""


@dataclass(frozen=True)
class SharedInput:
    """The module's input enters the parallel region once for the column layers inside
    it: a hook on the module's forward applies ``copy_to_region`` (under sequence
    parallelism ``gather_from_sequence``) to its first positional argument, or to the
    keyword argument ``argument`` when it is called without positional ones.

    Attributes:
        argument: the keyword the input comes by when not positional (Hugging Face passes
            ``hidden_states=`` to attention).
    """

    argument: str = "hidden_states"


@dataclass(frozen=True)
class LocalHeads:
    """Divide the module's integer ``attributes`` by ``tp``.

    Attributes:
        attributes: names such as ``("num_heads", "num_key_value_heads")``.
        required: refuse a module lacking one (False: skip the missing ones, for code that
            has them in some versions only).
    """

    attributes: tuple[str, ...]
    required: bool = True


@dataclass(frozen=True)
class SequenceSplit:
    """Under sequence parallelism the module runs on this rank's slice of the sequence;
    its parameters' gradients are summed over the group. Nothing otherwise."""


Style = (ColwiseLinear | RowwiseLinear | VocabEmbedding | SharedInput | LocalHeads
         | SequenceSplit)
Plan = Mapping[str, Style | tuple[Style, ...]]
_REPLACING = (ColwiseLinear, RowwiseLinear, VocabEmbedding)
_STYLES = (*_REPLACING, SharedInput, LocalHeads, SequenceSplit)
#: Styles that cut a weight's rows into the same equal shards: a parameter may be shared
#: (tied) between modules of these styles only.
_ROW_SHARDED = (ColwiseLinear, VocabEmbedding)


# ------------------------------------------------------------------ checking
def _styles_of(pattern: str, value: Any) -> tuple[Style, ...]:
    styles = value if isinstance(value, tuple) else (value,)
    if not styles:
        raise PlanError(f"plan entry {pattern!r} has no style")
    for style in styles:
        if not isinstance(style, _STYLES):
            raise PlanError(f"plan entry {pattern!r}: {style!r} is not a style (one of "
                            f"{', '.join(s.__name__ for s in _STYLES)})")
    return styles


def check_plan(model: nn.Module, plan: Plan, tp: int) -> dict[str, tuple[Style, ...]]:
    """Match ``plan`` against ``model`` for a group of ``tp`` ranks, without changing
    anything.

    Returns:
        The styles of every module the plan names, by module name, in the order of
        ``model.named_modules()``.

    Raises:
        PlanError: the first thing wrong, naming the pattern or module.
    """
    if not isinstance(plan, Mapping):
        raise PlanError(f"a plan is a mapping of patterns to styles, got "
                        f"{type(plan).__name__}")
    if not isinstance(tp, int) or tp < 1:
        raise PlanError(f"tp must be a positive integer, got {tp!r}")
    modules = dict(model.named_modules())
    names_of: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names_of.setdefault(id(module), []).append(name)

    styles: dict[str, list[Style]] = {}
    source: dict[tuple[str, type], str] = {}
    for pattern, value in plan.items():
        if not isinstance(pattern, str):
            raise PlanError(f"plan keys are module-name patterns (str), got {pattern!r}")
        entry = _styles_of(pattern, value)
        matched = [name for name in modules if fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            raise PlanError(f"plan entry {pattern!r} matches no module of "
                            f"{type(model).__name__}")
        for name in matched:
            for style in entry:
                earlier = source.get((name, type(style)))
                if earlier is not None:
                    raise PlanError(f"module {name!r} gets {type(style).__name__} from both "
                                    f"{earlier!r} and {pattern!r}")
                source[(name, type(style))] = pattern
                styles.setdefault(name, []).append(style)

    for name, entry in styles.items():
        module = modules[name]
        replacing = [s for s in entry if isinstance(s, _REPLACING)]
        if len(replacing) > 1:
            raise PlanError(f"module {name!r} gets two replacing styles: "
                            f"{', '.join(type(s).__name__ for s in replacing)}")
        if replacing and len(entry) > 1:
            others = [type(s).__name__ for s in entry if s is not replacing[0]]
            raise PlanError(f"module {name!r} is replaced ({type(replacing[0]).__name__}); "
                            f"it cannot also get {', '.join(others)}")
        if replacing and not name:
            raise PlanError(f"the plan replaces the model itself ({type(module).__name__}); "
                            f"name a submodule")
        if replacing and len(names_of[id(module)]) > 1:
            raise PlanError(f"module {name!r} is also registered as "
                            f"{[n for n in names_of[id(module)] if n != name]}: replacing "
                            f"it under one name would leave the other whole")
        for style in entry:
            _check_style(name, module, style, tp)
        if any(isinstance(s, SharedInput) for s in entry):
            inside = [n for n, e in styles.items() if n.startswith(name + ".")
                      and any(isinstance(s, ColwiseLinear) for s in e)]
            if not inside:
                raise PlanError(f"module {name!r} has SharedInput but no ColwiseLinear "
                                f"inside it")
    _check_shared_parameters(model, styles)
    order = list(modules)
    return {name: tuple(styles[name]) for name in sorted(styles, key=order.index)}


def _check_style(name: str, module: nn.Module, style: Style, tp: int) -> None:
    kind = type(module).__name__
    try:
        if isinstance(style, (ColwiseLinear, RowwiseLinear)):
            if not isinstance(module, nn.Linear):
                raise PlanError(f"{type(style).__name__} needs an nn.Linear, got {kind}")
            if style.multiple_of < 1:
                raise PlanError(f"multiple_of must be >= 1, got {style.multiple_of}")
            if isinstance(style, ColwiseLinear):
                shard_size(module.out_features, tp, "out_features", style.multiple_of)
            else:
                shard_size(module.in_features, tp, "in_features", style.multiple_of)
        elif isinstance(style, VocabEmbedding):
            if not isinstance(module, nn.Embedding):
                raise PlanError(f"VocabEmbedding needs an nn.Embedding, got {kind}")
            shard_size(module.num_embeddings, tp, "num_embeddings")
            unsupported = [a for a in ("max_norm", "scale_grad_by_freq", "sparse")
                           if getattr(module, a)]
            if unsupported:
                raise PlanError(f"VocabEmbedding does not support {unsupported}")
        elif isinstance(style, LocalHeads):
            if not style.attributes or not all(isinstance(a, str) for a in style.attributes):
                raise PlanError(f"LocalHeads needs attribute names, got {style.attributes!r}")
            for attr in style.attributes:
                if not hasattr(module, attr):
                    if style.required:
                        raise PlanError(f"LocalHeads: {kind} has no attribute {attr!r}")
                    continue
                value = getattr(module, attr)
                if isinstance(value, bool) or not isinstance(value, int):
                    raise PlanError(f"LocalHeads: {attr} is {value!r}, not an integer")
                shard_size(value, tp, attr)
        elif isinstance(style, SharedInput) and not isinstance(style.argument, str):
            raise PlanError(f"SharedInput.argument must be a str, got {style.argument!r}")
    except (PlanError, ValueError) as exc:
        raise PlanError(f"module {name!r} ({kind}): {exc}") from None


def _check_shared_parameters(model: nn.Module, styles: dict[str, list[Style]]) -> None:
    """A parameter of a replaced module may be shared (tied) only with other replaced
    modules that cut it the same way: a whole copy elsewhere would silently diverge."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((mod_name, attr))
    for name, entry in styles.items():
        style = next((s for s in entry if isinstance(s, _REPLACING)), None)
        if style is None:
            continue
        module = model.get_submodule(name)
        for attr, param in module._parameters.items():
            shared = [o for o in owners.get(id(param), []) if o != (name, attr)]
            for other, other_attr in shared:
                other_style = next((s for s in styles.get(other, ())
                                    if isinstance(s, _REPLACING)), None)
                if not (attr == other_attr == "weight" and isinstance(style, _ROW_SHARDED)
                        and isinstance(other_style, _ROW_SHARDED)):
                    how = type(other_style).__name__ if other_style else "not sharded"
                    raise PlanError(f"parameter {name}.{attr} is shared with "
                                    f"{other}.{other_attr} ({how}), which the plan does not "
                                    f"cut the same way")


# ------------------------------------------------------------------ applying
def _replacement(module: nn.Module, style: Style, group: Group, sequence_parallel: bool,
                 seq_dim: int, in_region: bool) -> nn.Module:
    if isinstance(style, ColwiseLinear):
        return ColumnParallelLinear.from_linear(
            module, group, gather_output=style.gather_output,
            sequence_parallel=sequence_parallel, seq_dim=seq_dim,
            overlap_grad_reduce=style.overlap_grad_reduce, input_in_region=in_region,
            multiple_of=style.multiple_of)
    if isinstance(style, RowwiseLinear):
        return RowParallelLinear.from_linear(
            module, group, input_is_parallel=style.input_is_parallel,
            sequence_parallel=sequence_parallel, seq_dim=seq_dim,
            multiple_of=style.multiple_of)
    return VocabParallelEmbedding.from_embedding(module, group,
                                                 sequence_parallel=sequence_parallel,
                                                 seq_dim=seq_dim)


def _enter_region_hook(name: str, style: SharedInput, group: Group, sequence_parallel: bool,
                       seq_dim: int):
    def enter(x):
        if sequence_parallel:
            return gather_from_sequence(x, group, seq_dim)
        return copy_to_region(x, group)

    def hook(module, args, kwargs):
        if args:
            return (enter(args[0]), *args[1:]), kwargs
        if style.argument in kwargs:
            return args, {**kwargs, style.argument: enter(kwargs[style.argument])}
        raise TypeError(f"SharedInput on {name!r}: called with neither a positional "
                        f"argument nor {style.argument}=")

    return hook


def parallelize(model: nn.Module, plan: Plan, group: Group = None, *,
                sequence_parallel: bool = False, seq_dim: int = 1) -> nn.Module:
    """Shard ``model`` in place for the tensor-parallel ``group`` by ``plan``.

    Every rank of the group calls it on the same model (the same values: each keeps its
    shards of them). The whole plan is checked first (:func:`check_plan`); nothing is
    changed when it is refused.

    Args:
        model: the whole model, on this rank.
        plan: module-name patterns to styles (see the module's documentation).
        group: the tensor-parallel process group (None: the default group).
        sequence_parallel: keep the tensors between the parallel regions cut along the
            sequence (``seq_dim``); see :mod:`minitp.layers`.
        seq_dim: the sequence dimension of the activations (1 for ``[B, T, d]``).

    Returns:
        ``model``, its modules replaced and hooked.

    Raises:
        PlanError: the plan does not fit the model (nothing was changed).
    """
    if not isinstance(seq_dim, int):
        raise PlanError(f"seq_dim must be an int, got {seq_dim!r}")
    tp = group_size(group)
    styles = check_plan(model, plan, tp)
    regions = [n for n, e in styles.items() if any(isinstance(s, SharedInput) for s in e)]
    new_params: dict[int, nn.Parameter] = {}  # tied weights: one shard, shared again
    for name, entry in styles.items():
        module = model.get_submodule(name)
        for style in entry:
            if isinstance(style, _REPLACING):
                in_region = any(name.startswith(r + ".") for r in regions)
                new = _replacement(module, style, group, sequence_parallel, seq_dim,
                                   in_region)
                old_weight = module.weight
                if id(old_weight) in new_params:
                    new.weight = new_params[id(old_weight)]
                else:
                    new_params[id(old_weight)] = new.weight
                parent_name, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent_name), child, new)
            elif isinstance(style, SharedInput):
                module.register_forward_pre_hook(
                    _enter_region_hook(name, style, group, sequence_parallel, seq_dim),
                    with_kwargs=True)
            elif isinstance(style, LocalHeads):
                for attr in style.attributes:
                    if hasattr(module, attr):
                        setattr(module, attr, getattr(module, attr) // tp)
            elif isinstance(style, SequenceSplit) and sequence_parallel:
                for param in module.parameters():
                    if not getattr(param, "_minitp_summed", False):
                        sum_gradient_over_group(param, group)
                        param._minitp_summed = True
    return model

