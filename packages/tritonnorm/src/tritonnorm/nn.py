"""tritonnorm's ``nn.Module``s, and ``replace_rms_norms``, which swaps a model's RMSNorm
modules for them in place.

``RMSNorm`` and ``FusedAddRMSNorm`` are thin modules over ``rms_norm`` and
``fused_add_rms_norm`` (``tritonnorm.ops``).

What is swapped:

* every ``torch.nn.RMSNorm`` (and every subclass of it that does not override ``forward``);
* every module whose class declares itself compatible with the class attribute
  ``__tritonnorm_compatible__ = True``. The declaration is a promise that the module
  computes ``x * rsqrt(mean(x**2, dim=-1, keepdim=True) + eps) * weight`` over the last
  dimension of its one input (in at least float32 for half-precision x, the result in x's
  dtype), where ``weight`` is its only parameter, 1-D, and ``eps`` is its ``eps`` or
  ``variance_epsilon`` attribute (a number >= 0, or None as ``torch.nn.RMSNorm`` means
  it). It has no buffers and no submodules. A class may also be declared from outside
  (``LlamaRMSNorm.__tritonnorm_compatible__ = True``); ``False`` opts a class out, an
  ``nn.RMSNorm`` subclass included. Gemma's ``(1 + weight)`` norm must not declare it.

What is kept: the weight (the same ``Parameter`` object, so optimizers, DDP and anything
else holding it keep working, and ``state_dict`` keys and values are unchanged), eps,
device and dtype (those of the weight), training mode, and the module hooks (forward,
forward-pre, backward and state-dict hooks: the new module shares the old one's hook
dictionaries, so handles returned before the swap still remove them). A norm registered
under several names (a tied or shared instance) becomes one tritonnorm module registered
under the same names. Not kept: references to the old module held outside the model, and
any other attribute set on the old instance.

What is refused (``ValueError`` naming every such module, before anything is changed;
``strict=False`` leaves them as they are with a warning instead):

* ``elementwise_affine=False`` (no weight): ``tritonnorm.RMSNorm`` always has a learned
  weight. A stand-in ones tensor would be either a new parameter (a new state-dict key,
  and an optimizer would train it) or a tensor created on the input's device at call
  time (a per-call allocation, or a cache that CUDA-graph capture cannot own);
* a ``normalized_shape`` of more than one dimension: tritonnorm normalises the last
  dimension only;
* a module whose ``forward`` is replaced on the instance (accelerate's hooks, for one),
  one with parametrizations, and a declared module that breaks the rule above.
"""

from __future__ import annotations

import math
import numbers
import warnings

import torch
from torch import nn
from torch.nn.utils import parametrize

from tritonnorm.ops import fused_add_rms_norm, rms_norm

__all__ = ["FusedAddRMSNorm", "MachineEpsRMSNorm", "RMSNorm", "replace_rms_norms",
           "to_tritonnorm"]


class RMSNorm(nn.Module):
    """Root-mean-square normalisation over the last dimension with a learned gain.

    Its only parameter is ``weight`` (shape (hidden_size,), initialised to ones), so its
    state dict loads into ``torch.nn.RMSNorm(hidden_size)`` and back. On CUDA it runs the
    Triton kernels (under ``torch.compile`` as Triton operators Inductor launches itself).

    Args:
        hidden_size: H, the size of the normalised last dimension.
        eps: added to the mean square before the square root.
        device: where to create ``weight``.
        dtype: dtype of ``weight``.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
        if dtype is not None and not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point dtype, got {dtype}")
        self.hidden_size = hidden_size
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class FusedAddRMSNorm(RMSNorm):
    """``forward(x, residual) -> (norm(x + residual), x + residual)``, fused.

    The module form of ``fused_add_rms_norm``: same parameter (and state dict) as
    ``RMSNorm``. The sum takes x's dtype; pass the residual stream as ``x``.
    """

    def forward(self, x: torch.Tensor, residual: torch.Tensor):  # type: ignore[override]
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


# ---------------------------------------------------------------------------- replace_rms_norms

_TorchRMSNorm = getattr(nn, "RMSNorm", None)  # PyTorch >= 2.4

# The attributes that hold an nn.Module's hooks; the replacement shares the old module's
# objects, so the RemovableHandles given out for them keep working.
_HOOK_ATTRS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_is_full_backward_hook",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)

_EPS_NAMES = ("eps", "variance_epsilon")


class _Unsupported(Exception):
    """A candidate module that cannot be swapped exactly; the message says why."""


_NONE_EPS: dict[torch.dtype, float] = {}


def _none_eps_table() -> dict[torch.dtype, float]:
    """The eps ``torch.nn.RMSNorm(eps=None)`` uses, by input dtype, in this PyTorch.

    PyTorch 2.7 and later use the machine epsilon of the computation dtype (float32's for
    float16, bfloat16 and float32 inputs, float64's for float64); earlier releases used the
    input dtype's own (0.0078 for bfloat16). The two differ for half precision only, so
    those dtypes are asked once, on the CPU: with x = 2**-6 in every position the output
    is ~1.0 under float32's epsilon and below 0.5 under float16's or bfloat16's.
    """
    if not _NONE_EPS:
        table = {torch.float32: torch.finfo(torch.float32).eps,
                 torch.float64: torch.finfo(torch.float64).eps}
        for dtype in (torch.float16, torch.bfloat16):
            x = torch.full((1, 4), 2.0**-6, dtype=dtype)
            with torch.no_grad():
                y = torch.nn.functional.rms_norm(x, (4,), None, None)
            uses_float32 = y.float().min().item() > 0.9
            table[dtype] = torch.finfo(torch.float32 if uses_float32 else dtype).eps
        _NONE_EPS.update(table)
    return _NONE_EPS


class MachineEpsRMSNorm(RMSNorm):
    """``tritonnorm.RMSNorm`` with ``eps=None``, meaning what ``torch.nn.RMSNorm`` means.

    eps is picked per call from the input's dtype: ``torch.finfo(torch.float32).eps`` for
    float32, float16 and bfloat16 inputs and ``torch.finfo(torch.float64).eps`` for float64
    (PyTorch >= 2.7; on older PyTorch, whatever its ``nn.RMSNorm`` does, found once at
    construction). ``replace_rms_norms`` builds one for every ``eps=None`` module; state
    dicts are interchangeable with ``RMSNorm``'s and ``torch.nn.RMSNorm``'s.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if eps is not None:
            raise ValueError(f"MachineEpsRMSNorm takes eps=None only, got {eps!r}; "
                             "use tritonnorm.RMSNorm for a fixed eps")
        super().__init__(hidden_size, device=device, dtype=dtype)
        self.eps = None
        # One shared dict, filled before any forward: a lookup by dtype that torch.compile
        # traces as a constant.
        self._eps_by_dtype = _none_eps_table()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self._eps_by_dtype.get(x.dtype, torch.finfo(torch.float32).eps)
        return rms_norm(x, self.weight, eps)


def _declared(module: nn.Module) -> bool | None:
    flag = getattr(type(module), "__tritonnorm_compatible__", None)
    return None if flag is None else flag is True


def _is_candidate(module: nn.Module) -> bool:
    """Whether the documented rule asks for ``module`` to be swapped."""
    if isinstance(module, RMSNorm):
        return False
    declared = _declared(module)
    if declared is not None:
        return declared
    return (
        _TorchRMSNorm is not None
        and isinstance(module, _TorchRMSNorm)
        and type(module).forward is _TorchRMSNorm.forward
    )


def _checked_eps(value, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _Unsupported(f"{where} must be a Python number or None, got {value!r}")
    value = float(value)
    if not (value >= 0.0 and math.isfinite(value)):
        raise _Unsupported(f"{where} must be finite and >= 0, got {value}")
    return value


def _weight_and_eps(module: nn.Module) -> tuple[nn.Parameter, float | None]:
    """The weight and eps of a candidate, or ``_Unsupported`` saying why it cannot swap."""
    is_torch = _TorchRMSNorm is not None and isinstance(module, _TorchRMSNorm)
    if is_torch:
        shape = tuple(module.normalized_shape)
        if len(shape) != 1:
            raise _Unsupported(
                f"normalized_shape={shape} normalises the last {len(shape)} dimensions; "
                "tritonnorm normalises the last dimension only")
        if module.weight is None:
            raise _Unsupported(
                "elementwise_affine=False: tritonnorm.RMSNorm always has a learned weight, "
                "and adding one would change the state dict and the parameters")
    if "forward" in vars(module):
        raise _Unsupported(
            "its forward is replaced on the instance (by accelerate's hooks, say); "
            "swapping the module would drop that")
    if parametrize.is_parametrized(module):
        raise _Unsupported("it has parametrizations (torch.nn.utils.parametrize)")
    weight = module._parameters.get("weight")
    if not isinstance(weight, nn.Parameter):
        raise _Unsupported("it has no `weight` Parameter")
    if weight.dim() != 1 or weight.numel() == 0 or not weight.dtype.is_floating_point:
        raise _Unsupported(
            f"its weight must be 1-D, non-empty and floating point, got shape "
            f"{tuple(weight.shape)} and {weight.dtype}")
    if is_torch and tuple(weight.shape) != tuple(module.normalized_shape):
        raise _Unsupported(f"weight of shape {tuple(weight.shape)} does not match "
                           f"normalized_shape={tuple(module.normalized_shape)}")
    others = [n for n, p in module._parameters.items() if p is not None and n != "weight"]
    others += [n for n, b in module._buffers.items() if b is not None]
    others += [n for n, m in module._modules.items() if m is not None]
    if others:
        raise _Unsupported(
            f"it holds more than `weight` ({', '.join(others)}), which the swap would lose")

    if is_torch:
        return weight, _checked_eps(module.eps, "eps")
    found = {n: getattr(module, n) for n in _EPS_NAMES if hasattr(module, n)}
    if not found:
        raise _Unsupported("it has neither an `eps` nor a `variance_epsilon` attribute")
    values = {n: _checked_eps(v, n) for n, v in found.items()}
    if len(set(values.values())) > 1:
        raise _Unsupported(f"its eps and variance_epsilon differ ({values})")
    return weight, next(iter(values.values()))


def to_tritonnorm(module: nn.Module) -> RMSNorm:
    """The ``tritonnorm.RMSNorm`` that replaces ``module`` (which is left unchanged).

    It holds ``module``'s weight Parameter itself (no copy), its eps (``eps=None`` gives a
    ``MachineEpsRMSNorm``), training mode and hooks. ``replace_rms_norms`` uses it for each
    module it swaps; call it directly for a model that is itself one norm.

    Raises:
        ValueError: ``module`` cannot be swapped exactly (the message says why), or the
            rule in this module's docstring does not ask for it to be swapped.
    """
    if not _is_candidate(module):
        raise ValueError(
            f"{type(module).__name__} is not swapped: it is neither a torch.nn.RMSNorm nor "
            "declares __tritonnorm_compatible__ = True (or it is already tritonnorm's)")
    try:
        weight, eps = _weight_and_eps(module)
    except _Unsupported as e:
        raise ValueError(f"cannot swap {type(module).__name__} exactly: {e}") from None
    return _build(module, weight, eps)


def _build(module: nn.Module, weight: nn.Parameter, eps: float | None) -> RMSNorm:
    # Built on the meta device: the ones weight it starts with is replaced at once.
    if eps is None:
        new = MachineEpsRMSNorm(weight.shape[0], device="meta", dtype=weight.dtype)
    else:
        new = RMSNorm(weight.shape[0], eps=eps, device="meta", dtype=weight.dtype)
    new.weight = weight
    new.training = module.training
    for attr in _HOOK_ATTRS:
        if attr in vars(module):
            new.__dict__[attr] = vars(module)[attr]
    return new


def replace_rms_norms(model: nn.Module, *, strict: bool = True) -> int:
    """Swap every RMSNorm in ``model`` for ``tritonnorm.RMSNorm``, in place.

    Swapped: ``torch.nn.RMSNorm`` (and subclasses that keep its ``forward``) and modules
    whose class sets ``__tritonnorm_compatible__ = True``: a 1-D ``weight`` Parameter as
    the only parameter, an ``eps`` or ``variance_epsilon`` attribute, no buffers or
    submodules, and ``x * rsqrt(mean(x**2, -1) + eps) * weight`` over the last dim.
    ``__tritonnorm_compatible__ = False`` opts a class out. Modules already of tritonnorm
    are left alone and not counted, so a second call returns 0.

    The weight Parameter is kept (the same object: optimizers and DDP holding it keep
    working, state-dict keys and values do not change), and so are eps (``eps=None`` keeps
    ``nn.RMSNorm``'s meaning through ``MachineEpsRMSNorm``), device, dtype, training mode
    and hooks. A norm shared by several parents stays one shared module. Swap before
    wrapping the model (DDP, FSDP, ``torch.compile``); references to the old modules held
    outside the model still point at them.

    Args:
        model: the model to modify; it cannot itself be a norm (see ``to_tritonnorm``).
        strict: True (the default) raises if any candidate cannot be swapped exactly
            (``elementwise_affine=False``, a ``normalized_shape`` of more than one
            dimension, a declared module that breaks the rule), before changing anything.
            False leaves those modules as they are, with one warning naming them.

    Returns:
        How many distinct modules were swapped (a shared instance counts once).

    Raises:
        ValueError: as above with ``strict=True``, or ``model`` itself is a norm.
        TypeError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if _is_candidate(model):
        raise ValueError(
            f"the model itself is a {type(model).__name__}: there is no parent to put the "
            "replacement in; use tritonnorm.nn.to_tritonnorm(model) instead")

    # Every (parent, name) slot that holds a candidate; a shared instance has several.
    slots: list[tuple[nn.Module, str, nn.Module]] = []
    names: dict[int, str] = {}
    for parent_name, parent in model.named_modules():
        for name, child in parent._modules.items():
            if child is not None and _is_candidate(child):
                slots.append((parent, name, child))
                names.setdefault(id(child), f"{parent_name}.{name}" if parent_name else name)

    new_modules: dict[int, RMSNorm] = {}
    refused: dict[int, str] = {}
    for _, _, child in slots:
        key = id(child)
        if key in new_modules or key in refused:
            continue
        try:
            new_modules[key] = _build(child, *_weight_and_eps(child))
        except _Unsupported as e:
            refused[key] = f"{names[key]} ({type(child).__name__}): {e}"

    if refused:
        listing = "\n  ".join(refused.values())
        if strict:
            raise ValueError(
                "replace_rms_norms: these modules cannot be swapped for tritonnorm.RMSNorm "
                f"exactly, so nothing was changed:\n  {listing}\n"
                "Pass strict=False to swap the others and leave these as they are.")
        warnings.warn(f"replace_rms_norms left these modules as they are:\n  {listing}",
                      UserWarning, stacklevel=2)

    for parent, name, child in slots:
        new = new_modules.get(id(child))
        if new is not None:
            setattr(parent, name, new)
    return len(new_modules)
