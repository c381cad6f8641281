"""tritonnorm's ``nn.Module``s, and ``replace_rms_norms``, which swaps a model's RMSNorm
modules for them in place.

``RMSNorm`` and ``FusedAddRMSNorm`` are thin modules over ``rms_norm`` and
``fused_add_rms_norm`` (``tritonnorm.ops``).

What is swapped:

* every ``torch.nn.RMSNorm`` (and every subclass of it that does not override ``forward``),
  with a weight or without (``elementwise_affine=False`` becomes
  ``RMSNorm(elementwise_affine=False)``: no parameter, no state-dict key);
* every module whose class declares itself compatible with the class attribute
  ``__tritonnorm_compatible__ = True``. The declaration is a promise that the module
  computes ``x * rsqrt(mean(x**2, dim=-1, keepdim=True) + eps) * weight`` over the last
  dimension of its one input (in at least float32 for half-precision x, the result in x's
  dtype), where ``weight`` is its only parameter, 1-D, and ``eps`` is its ``eps`` or
  ``variance_epsilon`` attribute (a number >= 0, or None as ``torch.nn.RMSNorm`` means
  it). It has no buffers and no submodules. A class may also be declared from outside;
  ``False`` opts a class out, an ``nn.RMSNorm`` subclass included;
* every module with the structure of a Hugging Face ``transformers`` norm (a class outside
  torch whose only tensor is a 1-D ``weight`` Parameter, with an ``eps`` or
  ``variance_epsilon`` attribute and no submodules) whose forward, run on small random
  CPU inputs (a copy holding a random weight of its own, float32 and bfloat16, two
  scales), agrees with exactly one formula tritonnorm has: Llama's
  ``weight * x_hat.to(dtype)`` (casting mode "llama"), OLMo 2's
  ``(weight * x_hat).to(dtype)`` ("none") or Gemma's ``(x_hat * (1 + weight.float()))
  .type_as(x)`` ("gemma", offset 1). The probe decides from what the module computes, so
  no table of class names is needed (none of the tested families needed one). A module
  that agrees with none is left alone, with a warning when its class name says RMSNorm or
  it computes an RMSNorm in float32 (T5's, which rounds half precision its own way).

A module whose ``forward`` takes more than the hidden states (the gated norms of Mamba 2,
Bamba, GraniteMoeHybrid, NemotronH and Zamba2: ``forward(hidden_states, gate=None)``) is
never swapped: tritonnorm's takes one tensor. TorchScript modules cannot be changed: their
norms are left alone with a warning. Everything is checked and every replacement built
before the first module is swapped, so a refusal leaves the model as it was.

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

* a ``normalized_shape`` of more than one dimension: tritonnorm normalises the last
  dimension only;
* a module whose ``forward`` is replaced on the instance (accelerate's hooks, for one),
  one with parametrizations, and a declared module that breaks the rule above (its
  forward takes more than one input, say).
"""

from __future__ import annotations

import copy
import inspect
import math
import numbers
import warnings

import torch
from torch import nn
from torch.nn.utils import parametrize

from tritonnorm.limits import check_eps
from tritonnorm.ops import fused_add_rms_norm, rms_norm
from tritonnorm.reference import check_mode, rms_norm_reference

__all__ = ["FusedAddRMSNorm", "MachineEpsRMSNorm", "RMSNorm", "replace_rms_norms",
           "to_tritonnorm"]


class RMSNorm(nn.Module):
    """Root-mean-square normalisation over the last dimension with a learned gain.

    Its only parameter is ``weight`` (shape (hidden_size,), initialised to ones, or to
    zeros with ``offset=1.0``, where the gain is ``1 + weight`` as in Gemma), so its state
    dict loads into ``torch.nn.RMSNorm(hidden_size)`` (or the Hugging Face norm it
    replaced) and back. On CUDA it runs the Triton kernels (under ``torch.compile`` as
    Triton operators Inductor launches itself).

    Args:
        hidden_size: H, the size of the normalised last dimension.
        eps: added to the mean square before the square root.
        casting_mode: ``"none"``, ``"gemma"`` or ``"llama"`` (see ``tritonnorm.rms_norm``).
        offset: 0.0, or 1.0 for a gain of ``1 + weight`` (added in float32).
        elementwise_affine: False for no weight at all (a scale-free norm).
        device: where to create ``weight``.
        dtype: dtype of ``weight``.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        *,
        casting_mode: str = "none",
        offset: float = 0.0,
        elementwise_affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
        if dtype is not None and not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point dtype, got {dtype}")
        _, offset = check_mode(casting_mode, offset, True if elementwise_affine else None)
        self.hidden_size = hidden_size
        self.eps = check_eps(eps)
        self.casting_mode = casting_mode
        self.offset = offset
        if elementwise_affine:
            init = torch.zeros if offset else torch.ones
            self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor, *, out_dtype: torch.dtype | None = None
                ) -> torch.Tensor:
        """``out_dtype``: y's dtype (as ``rms_norm``'s; under autocast, the autocast dtype
        saves the cast the next layer would make)."""
        return rms_norm(x, self.weight, self.eps, out_dtype=out_dtype,
                        casting_mode=self.casting_mode, offset=self.offset)

    def extra_repr(self) -> str:
        extra = "" if self.casting_mode == "none" else f", casting_mode={self.casting_mode!r}"
        extra += f", offset={self.offset}" if self.offset else ""
        extra += ", elementwise_affine=False" if self.weight is None else ""
        return f"{self.hidden_size}, eps={self.eps}{extra}"


class FusedAddRMSNorm(RMSNorm):
    """``forward(x, residual) -> (norm(x + residual), x + residual)``, fused.

    The module form of ``fused_add_rms_norm``: same parameter (and state dict) and
    arguments as ``RMSNorm``. The sum takes x's dtype; pass the residual stream as ``x``.
    Without a residual, ``forward(x)`` is ``RMSNorm``'s (y alone).
    """

    def forward(self, x: torch.Tensor,  # type: ignore[override]
                residual: torch.Tensor | None = None, *, out_dtype: torch.dtype | None = None):
        if residual is None:
            return super().forward(x, out_dtype=out_dtype)
        return fused_add_rms_norm(x, residual, self.weight, self.eps, out_dtype=out_dtype,
                                  casting_mode=self.casting_mode, offset=self.offset)


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
    """A candidate module that cannot be swapped exactly; the message says why.
    ``is_rms``: what it computes is an RMSNorm all the same (it is worth a warning)."""

    def __init__(self, why: str, is_rms: bool = False) -> None:
        super().__init__(why)
        self.is_rms = is_rms


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
        elementwise_affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if eps is not None:
            raise ValueError(f"MachineEpsRMSNorm takes eps=None only, got {eps!r}; "
                             "use tritonnorm.RMSNorm for a fixed eps")
        super().__init__(hidden_size, elementwise_affine=elementwise_affine, device=device,
                         dtype=dtype)
        self.eps = None
        # One shared dict, filled before any forward: a lookup by dtype that torch.compile
        # traces as a constant.
        self._eps_by_dtype = _none_eps_table()

    def forward(self, x: torch.Tensor, *, out_dtype: torch.dtype | None = None
                ) -> torch.Tensor:
        eps = self._eps_by_dtype.get(x.dtype, torch.finfo(torch.float32).eps)
        return rms_norm(x, self.weight, eps, out_dtype=out_dtype)


def _declared(module: nn.Module) -> bool | None:
    flag = getattr(type(module), "__tritonnorm_compatible__", None)
    return None if flag is None else flag is True


def _is_torch_norm(module: nn.Module) -> bool:
    return (_TorchRMSNorm is not None and isinstance(module, _TorchRMSNorm)
            and type(module).forward is _TorchRMSNorm.forward)


def _looks_like_rms_norm(module: nn.Module) -> bool:
    """The structure of a Hugging Face-style norm: a 1-D ``weight`` Parameter as its only
    tensor, an ``eps`` or ``variance_epsilon`` attribute, no submodules, and a class not
    of torch itself (``nn.LayerNorm(bias=False)`` has that structure and is no RMSNorm)."""
    if type(module).__module__.split(".")[0] == "torch":
        return False
    if not any(hasattr(module, n) for n in _EPS_NAMES):
        return False
    weight = module._parameters.get("weight")
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
        return False
    return (all(n == "weight" or p is None for n, p in module._parameters.items())
            and all(b is None for b in module._buffers.values())
            and all(m is None for m in module._modules.values()))


def _candidate_kind(module: nn.Module) -> str | None:
    """Why the rule asks for ``module`` to be swapped: "declared", "torch" or "probe"
    (a structure to prove by probing its forward); None where it does not."""
    if isinstance(module, RMSNorm):
        return None
    declared = _declared(module)
    if declared is not None:
        return "declared" if declared else None
    if _is_torch_norm(module):
        return "torch"
    return "probe" if _looks_like_rms_norm(module) else None


def _is_candidate(module: nn.Module) -> bool:
    """Whether the documented rule asks for ``module`` to be swapped."""
    return _candidate_kind(module) is not None


_ONE_INPUT = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _forward_inputs(module: nn.Module) -> str | None:
    """None where ``module``'s forward takes one input and nothing else, as tritonnorm's
    does; else its signature. A gated norm's ``forward(hidden_states, gate=None)`` computes
    an RMSNorm while the gate is None, and its model then passes a gate."""
    try:
        sig = inspect.signature(type(module).forward)
    except (TypeError, ValueError):  # no signature to read: nothing proves it
        return "(unreadable)"
    params = list(sig.parameters.values())[1:]  # without self
    if len(params) == 1 and params[0].kind in _ONE_INPUT:
        return None
    return str(sig)


def _checked_eps(value, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _Unsupported(f"{where} must be a Python number or None, got {value!r}")
    value = float(value)
    if not (value >= 0.0 and math.isfinite(value)):
        raise _Unsupported(f"{where} must be finite and >= 0, got {value}")
    return value


#: The formulas a probed module may compute: (casting_mode, offset). LlamaRMSNorm (and
#: Mistral's, Qwen2's, Qwen3's, ...): "llama"; OLMo 2's ``(weight * x_hat).to(dtype)``:
#: "none"; Gemma's ``x_hat * (1 + weight.float())``: "gemma" with offset 1.
_FORMULAS = (("llama", 0.0), ("none", 0.0), ("gemma", 1.0))
#: Probe inputs: (weight dtype, x dtype). The first two tell "llama" from "none" (the
#: output's dtype, and the rounding of x_hat before the weight multiplies it).
_PROBE_DTYPES = ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                 (torch.float32, torch.float32))
_PROBED: dict = {}


def _agrees(out, expected: torch.Tensor) -> bool:
    """Whether a probe's output is the candidate formula's: same shape and dtype, within
    a few units in the last place of the dtype, equal in all but a few elements (another
    order of float32 operations may round a few elements the other way)."""
    if not isinstance(out, torch.Tensor) or out.shape != expected.shape:
        return False
    if out.dtype != expected.dtype:
        return False
    ulp = torch.finfo(out.dtype).eps
    diff = (out.double() - expected.double()).abs()
    if not bool((diff <= 2 * ulp * expected.double().abs() + 1e-30).all()):
        return False
    return float((out != expected).double().mean()) <= 0.02


def _probe(module: nn.Module, weight: nn.Parameter, eps: float
           ) -> tuple[tuple[str, float] | None, bool]:
    """(the one formula of ``_FORMULAS`` that ``module``'s forward computes, or None where
    none or several agree or the forward fails; whether it computes an RMSNorm in float32
    at least), found by running it (on a shallow copy holding a random CPU weight of its
    own, hooks not called) on small random inputs of several dtypes and scales."""
    hidden = weight.shape[0]
    attrs = tuple(sorted((k, v) for k, v in vars(module).items()
                         if not k.startswith("_") and isinstance(v, (bool, int, float, str))))
    key = (type(module), eps, hidden, attrs)
    if key in _PROBED:
        return _PROBED[key]
    left = _agreeing(module, hidden, eps, _PROBE_DTYPES)
    found = left[0] if len(left) == 1 else None
    # T5's norm, say: an RMSNorm in float32 that rounds half precision its own way.
    is_rms = bool(left or _agreeing(module, hidden, eps, _PROBE_DTYPES[-1:]))
    _PROBED[key] = found, is_rms
    return found, is_rms


def _agreeing(module: nn.Module, hidden: int, eps: float, dtypes) -> list[tuple[str, float]]:
    """The formulas of ``_FORMULAS`` that ``module`` computes on probes of ``dtypes``."""
    gen = torch.Generator().manual_seed(0)
    probe = copy.copy(module)
    left = list(_FORMULAS)
    try:
        with torch.no_grad():
            for w_dtype, x_dtype in dtypes:
                w = (0.5 * torch.randn(hidden, generator=gen, dtype=torch.float64)).to(w_dtype)
                probe.__dict__["_parameters"] = {"weight": nn.Parameter(w, requires_grad=False)}
                # A scale where eps matters as much as the mean square, and one where not.
                for scale in {1.0, math.sqrt(eps) or 1.0}:
                    x = (scale * torch.randn(8, hidden, generator=gen,
                                             dtype=torch.float64)).to(x_dtype)
                    out = type(module).forward(probe, x)
                    left = [(mode, offset) for mode, offset in left
                            if _agrees(out, rms_norm_reference(x, w, eps, casting_mode=mode,
                                                               offset=offset))]
                    if not left:
                        break
    except Exception:  # noqa: BLE001 - a forward that cannot run on the probe proves nothing
        left = []
    return left


def _swap_spec(module: nn.Module) -> tuple[nn.Parameter | None, float | None, str, float]:
    """(weight, eps, casting_mode, offset) of a candidate, or ``_Unsupported`` saying why
    it cannot be swapped exactly."""
    kind = _candidate_kind(module)
    is_torch = _TorchRMSNorm is not None and isinstance(module, _TorchRMSNorm)
    if is_torch:
        shape = tuple(module.normalized_shape)
        if len(shape) != 1:
            raise _Unsupported(
                f"normalized_shape={shape} normalises the last {len(shape)} dimensions; "
                "tritonnorm normalises the last dimension only")
    if "forward" in vars(module):
        raise _Unsupported(
            "its forward is replaced on the instance (by accelerate's hooks, say); "
            "swapping the module would drop that")
    if parametrize.is_parametrized(module):
        raise _Unsupported("it has parametrizations (torch.nn.utils.parametrize)")
    weight = module._parameters.get("weight")
    if is_torch and weight is None and "weight" in module._parameters:
        if not module.elementwise_affine:
            weight = None  # a scale-free norm: swapped for RMSNorm(elementwise_affine=False)
    elif not isinstance(weight, nn.Parameter):
        raise _Unsupported("it has no `weight` Parameter")
    if weight is not None:
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
        eps = _checked_eps(module.eps, "eps")
    else:
        found = {n: getattr(module, n) for n in _EPS_NAMES if hasattr(module, n)}
        if not found:
            raise _Unsupported("it has neither an `eps` nor a `variance_epsilon` attribute")
        values = {n: _checked_eps(v, n) for n, v in found.items()}
        if len(set(values.values())) > 1:
            raise _Unsupported(f"its eps and variance_epsilon differ ({values})")
        eps = next(iter(values.values()))
    signature = None if kind == "torch" else _forward_inputs(module)
    if signature is not None:
        raise _Unsupported(f"its forward{signature} takes more than the hidden states, "
                           "and tritonnorm's takes nothing else")
    if kind != "probe":
        return weight, eps, "none", 0.0
    if eps is None:
        raise _Unsupported("its eps is None, whose meaning its forward decides")
    formula, is_rms = _probe(module, weight, eps)
    if formula is None:
        what = ("an RMSNorm in float32 but rounds half precision unlike every formula"
                if is_rms else "none of the RMSNorm formulas")
        raise _Unsupported(
            f"its forward computes {what} tritonnorm has (Llama's weight * x_hat.to(dtype), "
            "OLMo 2's (weight * x_hat).to(dtype), Gemma's x_hat * (1 + weight)) on a probe",
            is_rms)
    return weight, eps, *formula


def to_tritonnorm(module: nn.Module) -> RMSNorm:
    """The ``tritonnorm.RMSNorm`` that replaces ``module`` (which is left unchanged).

    It holds ``module``'s weight Parameter itself (no copy), its eps (``eps=None`` gives a
    ``MachineEpsRMSNorm``), the casting mode and offset of its formula, training mode and
    hooks. ``replace_rms_norms`` uses it for each module it swaps; call it directly for a
    model that is itself one norm.

    Raises:
        ValueError: ``module`` cannot be swapped exactly (the message says why), or the
            rule in this module's docstring does not ask for it to be swapped.
    """
    if not _is_candidate(module):
        raise ValueError(
            f"{type(module).__name__} is not swapped: it is neither a torch.nn.RMSNorm nor "
            "declares __tritonnorm_compatible__ = True nor has a Hugging Face norm's "
            "structure (or it is already tritonnorm's)")
    try:
        spec = _swap_spec(module)
    except _Unsupported as e:
        raise ValueError(f"cannot swap {type(module).__name__} exactly: {e}") from None
    return _build(module, *spec)


def _build(module: nn.Module, weight: nn.Parameter | None, eps: float | None,
           casting_mode: str = "none", offset: float = 0.0) -> RMSNorm:
    # Built on the meta device: the weight it starts with is replaced at once.
    if weight is None:
        hidden, dtype = int(module.normalized_shape[0]), None
    else:
        hidden, dtype = weight.shape[0], weight.dtype
    affine = weight is not None
    if eps is None:
        new = MachineEpsRMSNorm(hidden, elementwise_affine=affine, device="meta", dtype=dtype)
    else:
        new = RMSNorm(hidden, eps=eps, casting_mode=casting_mode, offset=offset,
                      elementwise_affine=affine, device="meta", dtype=dtype)
    if weight is not None:
        new.weight = weight
    new.training = module.training
    for attr in _HOOK_ATTRS:
        if attr in vars(module):
            new.__dict__[attr] = vars(module)[attr]
    return new


def _inside(name: str, roots: list[str]) -> bool:
    """Whether the module named ``name`` is one of ``roots`` or inside one."""
    return any(not r or name == r or name.startswith(f"{r}.") for r in roots)


def replace_rms_norms(model: nn.Module, *, strict: bool = True) -> int:
    """Swap every RMSNorm in ``model`` for ``tritonnorm.RMSNorm``, in place.

    Swapped:

    * ``torch.nn.RMSNorm`` (and subclasses that keep its ``forward``), with or without a
      weight;
    * modules whose class sets ``__tritonnorm_compatible__ = True`` (a 1-D ``weight``
      Parameter as the only parameter, an ``eps`` or ``variance_epsilon`` attribute, no
      buffers or submodules, ``x * rsqrt(mean(x**2, -1) + eps) * weight`` over the last
      dim); ``__tritonnorm_compatible__ = False`` opts a class out;
    * Hugging Face ``transformers`` norms (any class with that structure, outside torch):
      each is probed, its forward run on small random CPU inputs in bfloat16 and float32,
      and swapped with the casting mode and offset of the one formula it agrees with:
      Llama's ``weight * x_hat.to(dtype)`` ("llama": Llama, Mistral, Qwen2, Qwen3 and its
      q/k norms over head_dim, ...), OLMo 2's ``(weight * x_hat).to(dtype)`` ("none"), or
      Gemma's ``(x_hat * (1 + weight.float())).type_as(x)`` ("gemma", offset 1: Gemma,
      Gemma 2, Gemma 3). A module that agrees with none, or whose forward takes more than
      the hidden states (a gated norm's ``forward(hidden_states, gate=None)``), is left
      alone, with a warning when its class name says RMSNorm or it computes an RMSNorm in
      float32 (T5's), whatever ``strict`` says: a norm is never swapped for one that
      computes something else. TorchScript modules are left alone with a warning.

    Modules already of tritonnorm are left alone and not counted, so a second call returns
    0. The weight Parameter is kept (the same object: optimizers and DDP holding it keep
    working, state-dict keys and values do not change), and so are eps (``eps=None``
    keeps ``nn.RMSNorm``'s meaning through ``MachineEpsRMSNorm``), device, dtype,
    training mode and hooks. A norm shared by several parents stays one shared module.
    Swap before wrapping the model (DDP, FSDP, ``torch.compile``); references to the old
    modules held outside the model still point at them.

    Args:
        model: the model to modify; it cannot itself be a norm (see ``to_tritonnorm``).
        strict: True (the default) raises if any ``nn.RMSNorm`` or declared candidate
            cannot be swapped exactly (a ``normalized_shape`` of more than one dimension,
            a declared module that breaks the rule), before changing anything. False
            leaves those modules as they are, with one warning naming them.

    Returns:
        How many distinct modules were swapped (a shared instance counts once).

    Raises:
        ValueError: as above with ``strict=True``, or ``model`` itself is a norm.
        TypeError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if _candidate_kind(model) in ("declared", "torch"):
        raise ValueError(
            f"the model itself is a {type(model).__name__}: there is no parent to put the "
            "replacement in; use tritonnorm.nn.to_tritonnorm(model) instead")

    # TorchScript modules cannot be changed: their norms are left alone, with a warning.
    scripted: list[str] = []
    for name, m in model.named_modules():
        if isinstance(m, torch.jit.ScriptModule) and not _inside(name, scripted):
            scripted.append(name)
    if scripted:
        listing = ", ".join(n or "the model itself" for n in scripted)
        warnings.warn(f"replace_rms_norms: TorchScript modules ({listing}) cannot be "
                      "changed: their norms were left as they are. Swap the model's norms "
                      "before torch.jit.script or torch.jit.trace.", UserWarning, stacklevel=2)

    # Every (parent, name) slot that holds a candidate; a shared instance has several.
    slots: list[tuple[nn.Module, str, nn.Module]] = []
    names: dict[int, str] = {}
    for parent_name, parent in model.named_modules():
        if _inside(parent_name, scripted):
            continue
        for name, child in parent._modules.items():
            if child is not None and _is_candidate(child):
                slots.append((parent, name, child))
                names.setdefault(id(child), f"{parent_name}.{name}" if parent_name else name)

    new_modules: dict[int, RMSNorm] = {}
    refused: dict[int, str] = {}
    unproven: dict[int, str] = {}
    for _, _, child in slots:
        key = id(child)
        if key in new_modules or key in refused or key in unproven:
            continue
        try:
            new_modules[key] = _build(child, *_swap_spec(child))
        except _Unsupported as e:
            why = f"{names[key]} ({type(child).__name__}): {e}"
            if _candidate_kind(child) != "probe":
                refused[key] = why
            elif e.is_rms or "rmsnorm" in type(child).__name__.lower():
                unproven[key] = why

    if refused:
        listing = "\n  ".join(refused.values())
        if strict:
            raise ValueError(
                "replace_rms_norms: these modules cannot be swapped for tritonnorm.RMSNorm "
                f"exactly, so nothing was changed:\n  {listing}\n"
                "Pass strict=False to swap the others and leave these as they are.")
    left = [*refused.values(), *unproven.values()]
    if left:
        listing = "\n  ".join(left)
        warnings.warn(f"replace_rms_norms left these modules as they are:\n  {listing}",
                      UserWarning, stacklevel=2)

    # Everything is checked and built: now the swap, undone whole if a parent refuses.
    done: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        for parent, name, child in slots:
            new = new_modules.get(id(child))
            if new is not None:
                setattr(parent, name, new)
                done.append((parent, name, child))
    except BaseException:
        for parent, name, child in reversed(done):
            setattr(parent, name, child)
        raise
    return len(new_modules)
