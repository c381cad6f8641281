"""Float8 matrix products in the decoder blocks (``--precision fp8``), through torchao's
float8 training (``torchao.float8``, the ``lab2-trainer[fp8]`` extra).

**What runs in float8.** Every ``nn.Linear`` inside ``model.blocks``: attention's ``qkv``
and ``proj``, the feed-forward's ``w1``, ``w2`` (and SwiGLU's ``w3``). :func:`convert_blocks`
swaps each for torchao's ``Float8Linear``, a subclass of ``nn.Linear`` that keeps the same
fp32 weight ``Parameter`` and casts its operands to float8 (e4m3; gradients e5m2 in the
tensorwise recipe) with dynamic scales on every call, in the forward and in both products
of the backward. The embeddings, the LM head (the logits and the loss are where precision
matters most, and the vocabulary need not be a multiple of 16), the norms, attention's own
products and everything else run as ``--precision bf16`` runs them: under bf16 autocast.

**Recipes** (:data:`~lab2_trainer.config.FP8_RECIPES`, ``--fp8-recipe``): "tensorwise",
one scale per tensor (cuBLAS's float8 kernel: the fastest), and "rowwise", one scale per
row of each operand, rounded down to a power of two (CUTLASS's kernel: more accurate
where a few rows hold outliers, slower).

**Shapes.** ``torch._scaled_mm`` needs both dimensions of the right operand and the inner
dimension of each product to be multiples of 16: ``d_model`` and ``d_ff`` (``qkv``'s
``3 d_model`` follows), and in the weight gradient, whose inner dimension is the tokens,
the tokens of a micro-batch (:func:`shape_problem`).

**Devices.** Float8 tensor cores: CUDA compute capability 8.9 and later (Ada, Hopper,
Blackwell; :func:`device_problem`). On the CPU (the tests, the benchmarks' ``--device
cpu``) :func:`convert_blocks` emulates the products in float32 (torchao's ``emulate``): the
same casts and scales, none of the speed; ``lab2-train`` refuses fp8 there.

**Checkpoints.** ``Float8Linear`` holds the plain weight ``Parameter`` and no buffers, so
a converted model's state dict has nn.Linear's keys, shapes and dtypes: checkpoints of an
fp8 run are plain weights that a bf16 or fp32 model loads, and a run may resume across
precisions.

This module imports no torch at import time (the planner reads :func:`shape_problem`);
torchao is imported on the first conversion, which takes seconds.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from lab2_trainer.config import FP8_RECIPES, ModelConfig, flag

if TYPE_CHECKING:
    from torch import nn

#: The dimensions float8 matrix products take are multiples of this.
MULTIPLE = 16
#: The oldest CUDA compute capability with float8 tensor cores (Ada Lovelace).
MIN_CAPABILITY = (8, 9)
#: What a missing torchao is told to install.
INSTALL_HINT = "pip install 'lab2-trainer[fp8]' (torchao)"


# ------------------------------------------------------------------------------ rules
def shape_problem(config: ModelConfig, tokens: int | None = None) -> str | None:
    """What keeps ``config``'s blocks from running their products in float8, in one line;
    None: nothing.

    Args:
        config: the model's shape.
        tokens: the tokens of one micro-batch (sequences x context), the inner dimension
            of the weight gradients; None: not checked.
    """
    for name in ("d_model", "d_ff"):
        value = getattr(config, name)
        if value % MULTIPLE:
            return (f"--precision fp8 needs {flag(name)} to be a multiple of {MULTIPLE} (float8 "
                    f"matrix products take no other shapes); got {value}")
    if tokens is not None and tokens % MULTIPLE:
        return (f"--precision fp8 needs the tokens of a micro-batch (sequences x "
                f"{flag('context_length')}) to be a multiple of {MULTIPLE}, the inner "
                f"dimension of the weight gradients' float8 products; got {tokens}")
    return None


def run_problem(config: ModelConfig, tokens: int | None, tp: int) -> str | None:
    """:func:`shape_problem`, and what fp8 does not combine with yet: tensor parallelism
    (minitp's column and row layers are not ``nn.Linear``: nothing would run in float8).
    One line, or None."""
    problem = shape_problem(config, tokens)
    if problem is None and tp > 1:
        problem = (f"--precision fp8 with --tp {tp} is not supported yet: the tensor-parallel "
                   "layers are not nn.Linear, so no product would run in float8 (use --tp 1)")
    return problem


def device_problem(device_type: str, devices: int = 1) -> str | None:
    """Why the first ``devices`` devices of ``device_type`` cannot compute in float8, in
    one line; None: they can (CUDA, compute capability 8.9 or later)."""
    if device_type != "cuda":
        return (f"--precision fp8 needs a CUDA GPU of compute capability "
                f"{_text(MIN_CAPABILITY)} or later (float8 tensor cores); this run is on the "
                f"{device_type.upper()}")
    import torch

    if not torch.cuda.is_available():
        return "--precision fp8 needs a CUDA GPU; none is available"
    for index in range(min(devices, torch.cuda.device_count())):
        capability = tuple(torch.cuda.get_device_capability(index))
        if capability < MIN_CAPABILITY:
            name = torch.cuda.get_device_name(index)
            return (f"--precision fp8 needs a CUDA GPU of compute capability "
                    f"{_text(MIN_CAPABILITY)} or later (float8 tensor cores); GPU {index} "
                    f"({name}) is {_text(capability)}: use --precision bf16")
    return None


def torchao_problem() -> str | None:
    """One line when torchao's float8 training cannot be imported; None when it can."""
    try:
        _torchao()
    except ImportError as exc:
        return f"--precision fp8 needs torchao's float8 training ({exc}): {INSTALL_HINT}"
    return None


def _text(capability: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in capability)


# ------------------------------------------------------------------------- conversion
def converts(module: Any, fqn: str) -> bool:
    """Whether the module named ``fqn`` of a ``TransformerLM`` becomes a ``Float8Linear``:
    an ``nn.Linear`` inside the blocks (torchao's ``module_filter_fn``)."""
    from torch import nn

    return isinstance(module, nn.Linear) and fqn.startswith("blocks.")


def float8_config(recipe: str, *, emulate: bool = False) -> Any:
    """torchao's ``Float8LinearConfig`` of ``recipe`` (one of
    :data:`~lab2_trainer.config.FP8_RECIPES`), emulated in float32 with ``emulate``.

    Raises:
        ValueError: an unknown recipe.
    """
    if recipe not in FP8_RECIPES:
        raise ValueError(f"fp8 recipe must be one of {', '.join(FP8_RECIPES)}; got {recipe!r}")
    import dataclasses

    config = _torchao().Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=True) if emulate else config


def convert_blocks(model: nn.Module, recipe: str, *, emulate: bool | None = None) -> list[str]:
    """Swap the blocks' ``nn.Linear`` of ``model`` (a ``TransformerLM``) for torchao's
    ``Float8Linear`` with ``recipe``'s scaling, in place; the weights stay the same
    ``Parameter`` objects. Call it on the bare model, before compilation, activation
    checkpointing's recompute and any sharding (``parallelize`` does).

    Args:
        emulate: compute the float8 products in float32 (torchao's emulation); None:
            where the model is not on a CUDA device.

    Returns:
        The names of the modules converted, in model order.

    Raises:
        ValueError: an unknown recipe; a block matrix whose shape float8 products do not
            take; a CUDA device below compute capability 8.9 (unless emulated).
        ImportError: torchao is missing (:data:`INSTALL_HINT`).
    """
    targets = [(name, m) for name, m in model.named_modules() if converts(m, name)]
    for name, m in targets:
        bad = [n for n in (m.in_features, m.out_features) if n % MULTIPLE]
        if bad:
            raise ValueError(f"{name} is {m.in_features} x {m.out_features}: float8 products "
                             f"need both dimensions to be multiples of {MULTIPLE}")
    device = next(model.parameters()).device
    if emulate is None:
        emulate = device.type != "cuda"
    if not emulate:
        problem = _capability_problem(device)
        if problem is not None:
            raise ValueError(problem)
    config = float8_config(recipe, emulate=emulate)
    _torchao().convert_to_float8_training(model, config=config, module_filter_fn=converts)
    return [name for name, _ in targets]


def _capability_problem(device: Any) -> str | None:
    """Why ``device`` cannot run float8 products (not emulated), or None."""
    import torch

    if device.type != "cuda":
        return f"float8 products need a CUDA device (or emulate=True); the model is on {device}"
    capability = tuple(torch.cuda.get_device_capability(device))
    if capability < MIN_CAPABILITY:
        return (f"float8 products need CUDA compute capability {_text(MIN_CAPABILITY)} or "
                f"later; {device} is {_text(capability)}")
    return None


def float8_modules(model: nn.Module) -> list[str]:
    """The names of ``model``'s modules that compute in float8 (torchao's ``Float8Linear``)."""
    linear = _float8_linear()
    return [name for name, m in model.named_modules() if isinstance(m, linear)]


# ---------------------------------------------------------------------------- torchao
def _torchao() -> Any:
    """``torchao.float8``, imported once. torchao 0.18 registers an enum with torch's pytree
    in a way torch 2.15 deprecates: a warning at every import that tells a user nothing,
    silenced for the import alone."""
    with _quiet("torch.utils._pytree"):
        import torchao.float8 as float8
    return float8


def _float8_linear() -> type:
    with _quiet("torch.utils._pytree"):
        from torchao.float8.float8_linear import Float8Linear
    return Float8Linear


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
