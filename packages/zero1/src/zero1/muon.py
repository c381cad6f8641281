"""Muon: momentum orthogonalised by a Newton-Schulz iteration, for 2-D weight matrices.

One step for a matrix ``W`` with averaged gradient ``G`` (momentum μ, learning rate γ,
weight decay λ):

1. ``B ← μB + (1 - μ)G`` (the momentum buffer, an exponential average);
2. ``U ← (1 - μ)G + μB`` with ``nesterov`` (Nesterov-style look-ahead), else ``U ← B``;
3. ``O ← NS(U)``: five steps of the quintic Newton-Schulz iteration
   ``X ← aX + (bA + cA²)X``, ``A = XXᵀ``, ``(a, b, c) = (3.4445, -4.7750, 2.0315)``, from
   ``X = U / ‖U‖_F`` (on the wide orientation, so that ``A`` is the smaller Gram matrix),
   which pushes every singular value of ``U`` towards 1 (roughly ``UVᵀ`` of its SVD);
4. ``W ← W(1 - γλ) - γ·s·O`` with ``s = max(1, rows/cols)**0.5`` (``adjust_lr_fn``'s
   default, "original").

These are ``torch.optim.Muon``'s conventions (PyTorch 2.9 and later), with its defaults
and its state (``momentum_buffer``) and param-group keys, so state dicts move between the
two; :class:`Muon` adds ``ns_dtype`` (the dtype the iteration runs in: bfloat16 as
PyTorch's, float32, or None for the gradient's own) and runs on every torch this package
supports. Only 2-D parameters: give the others (biases, norms, usually the embedding and
the output layer) to AdamW.

The update needs the whole matrix (its singular values), so ZeRO's flat shards cannot
step it piece by piece: :mod:`zero1.whole_params` brings each matrix whole to one rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["NS_COEFFICIENTS", "Muon", "adjusted_lr", "newton_schulz"]

#: The quintic iteration's coefficients (a, b, c), tuned for the steepest slope at zero.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

#: ``adjust_lr_fn`` values: the factor on the learning rate of a ``rows × cols`` matrix.
_ADJUSTMENTS: dict[str | None, Callable[[int, int], float]] = {
    None: lambda rows, cols: math.sqrt(max(1.0, rows / cols)),
    "original": lambda rows, cols: math.sqrt(max(1.0, rows / cols)),
    # Matches the update's RMS to AdamW's (0.2 · sqrt(max(rows, cols))).
    "match_rms_adamw": lambda rows, cols: 0.2 * math.sqrt(max(rows, cols)),
    "spectral_unclamped": lambda rows, cols: math.sqrt(rows / cols),
}


def adjusted_lr(lr: float, shape: torch.Size | tuple[int, ...],
                adjust_lr_fn: str | None = None) -> float:
    """The learning rate a ``shape`` matrix's orthogonalised update is scaled by.

    Args:
        lr: the group's learning rate γ.
        shape: (rows, cols) of the matrix (output and input features of a Linear).
        adjust_lr_fn: None or "original" (γ·max(1, rows/cols)**0.5), "match_rms_adamw"
            (γ·0.2·max(rows, cols)**0.5) or "spectral_unclamped" (γ·(rows/cols)**0.5).
    """
    rows, cols = int(shape[0]), int(shape[1])
    return lr * _ADJUSTMENTS[adjust_lr_fn](rows, cols)


@torch.no_grad()
def newton_schulz(matrix: torch.Tensor, steps: int = 5,
                  coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                  eps: float = 1e-7, dtype: torch.dtype | None = torch.bfloat16) -> torch.Tensor:
    """``matrix`` orthogonalised: its singular values pushed towards 1 (into about
    [0.7, 1.2] after five steps), its singular vectors kept. Returns a new tensor in
    ``dtype`` (None: ``matrix``'s own).

    A 3-D ``matrix`` is a stack of matrices of one shape, each orthogonalised on its own
    (each normalised by its own norm) in batched products: one launch per product for the
    whole stack instead of one per matrix, which is what keeps the step off the host's
    critical path when a model has dozens of small matrices.

    Args:
        matrix: a 2-D tensor, or a 3-D stack ``[n, rows, cols]``.
        steps: iterations of ``X ← aX + (bA + cA²)X``, ``A = XXᵀ``.
        coefficients: (a, b, c).
        eps: the smallest norm divided by (a zero matrix stays zero).
        dtype: the dtype the iteration runs in.
    """
    if matrix.dim() not in (2, 3):
        raise ValueError(f"newton_schulz: expected a 2-D matrix or a 3-D stack of them, got "
                         f"shape {list(matrix.shape)}")
    a, b, c = coefficients
    x = matrix.to(dtype=dtype or matrix.dtype)  # every step below is out of place
    tall = x.size(-2) > x.size(-1)
    if tall:  # iterate on the wide orientation: A = XXᵀ is then the smaller Gram matrix
        x = x.mT
    # The spectral norm is at most the Frobenius norm: each matrix starts at norm <= 1.
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
    addmm = torch.addmm if x.dim() == 2 else torch.baddbmm
    for _ in range(steps):
        gram = x @ x.mT
        poly = addmm(gram, gram, gram, beta=b, alpha=c)  # bA + cA²
        x = addmm(x, poly, x, beta=a)  # aX + (bA + cA²)X
    return x.mT if tall else x


class Muon(Optimizer):
    """Muon for 2-D parameters (see the module docstring for the update).

    Args:
        params: 2-D tensors, or param-group dicts of them.
        lr: γ, the learning rate before the shape adjustment.
        weight_decay: λ, decoupled (``W ← W(1 - γλ)``), as PyTorch's default 0.1.
        momentum: μ.
        nesterov: use the Nesterov-style look-ahead ``(1 - μ)G + μB``.
        ns_coefficients: the iteration's (a, b, c).
        eps: the smallest norm the iteration divides by.
        ns_steps: Newton-Schulz iterations (under 100).
        adjust_lr_fn: how the learning rate depends on the shape (:func:`adjusted_lr`).
        ns_dtype: the dtype the iteration runs in (bfloat16, as PyTorch's; None: the
            gradient's own dtype, for float64 reference runs).

    Raises:
        ValueError: a parameter that is not 2-D (naming its group, position and shape),
            or a hyperparameter out of range.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        ns_dtype: torch.dtype | None = torch.bfloat16,
    ) -> None:
        if not lr >= 0:
            raise ValueError(f"Muon: lr must be >= 0, got {lr}")
        if not weight_decay >= 0:
            raise ValueError(f"Muon: weight_decay must be >= 0, got {weight_decay}")
        if not 0 <= momentum < 1:
            raise ValueError(f"Muon: momentum must be in [0, 1), got {momentum}")
        if not (isinstance(ns_steps, int) and 0 <= ns_steps < 100):
            raise ValueError(f"Muon: ns_steps must be an int in [0, 100), got {ns_steps!r}")
        if len(tuple(ns_coefficients)) != 3:
            raise ValueError(f"Muon: ns_coefficients must be three numbers (a, b, c), got "
                             f"{ns_coefficients!r}")
        if adjust_lr_fn not in _ADJUSTMENTS:
            raise ValueError(f"Muon: adjust_lr_fn must be one of "
                             f"{', '.join(map(repr, _ADJUSTMENTS))}, got {adjust_lr_fn!r}")
        if ns_dtype is not None and not (isinstance(ns_dtype, torch.dtype)
                                         and ns_dtype.is_floating_point):
            raise TypeError(f"Muon: ns_dtype must be a floating torch.dtype or None, got "
                            f"{ns_dtype!r}")
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum,
                    "nesterov": nesterov, "ns_coefficients": tuple(ns_coefficients),
                    "eps": eps, "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn,
                    "ns_dtype": ns_dtype}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of 2-D parameters (raises, adding nothing, for any other shape)."""
        params = param_group["params"]
        if isinstance(params, (set, frozenset)):
            super().add_param_group(param_group)  # torch.optim's error for sets
            return
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for j, p in enumerate(params):
            if isinstance(p, torch.Tensor) and p.dim() != 2:
                raise ValueError(
                    f"Muon: parameter {j} of param group {len(self.param_groups)} has shape "
                    f"{list(p.shape)}; Muon steps 2-D matrices only: give the other "
                    "parameters (biases, norms, embeddings) to AdamW")
            if isinstance(p, torch.Tensor) and p.is_complex():
                raise ValueError(f"Muon: parameter {j} of param group "
                                 f"{len(self.param_groups)} is complex; Muon steps real ones")
        super().add_param_group({**param_group, "params": params})

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            # torch.optim.Muon's state dicts lack ns_dtype: they orthogonalise in bfloat16.
            group.setdefault("ns_dtype", torch.bfloat16)
            group.setdefault("adjust_lr_fn", None)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One Muon step of every parameter that has a gradient.

        Args:
            closure: re-evaluates the model and returns the loss.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Muon: sparse gradients are not supported")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                params.append(p)
                grads.append(p.grad)
                bufs.append(state["momentum_buffer"])
            if params:
                self._step_group(group, params, grads, bufs)
        return loss

    @staticmethod
    def _step_group(group: dict[str, Any], params: list[torch.Tensor],
                    grads: list[torch.Tensor], bufs: list[torch.Tensor]) -> None:
        """One step of a param group's matrices that have gradients. The elementwise parts
        run as multi-tensor (``_foreach``) kernels, and matrices of one shape and dtype go
        through :func:`newton_schulz` as one stack: the same arithmetic as one matrix at a
        time, in a few launches instead of a few per matrix."""
        lr, momentum = group["lr"], group["momentum"]
        torch._foreach_lerp_(bufs, grads, 1 - momentum)
        updates = (torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"]
                   else bufs)
        torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        stacks: dict[tuple[Any, ...], list[int]] = {}
        for i, p in enumerate(params):
            stacks.setdefault((tuple(p.shape), p.dtype, p.device), []).append(i)
        for (shape, _, _), members in stacks.items():
            stacked = torch.stack([updates[i] for i in members])
            ortho = newton_schulz(stacked, group["ns_steps"], group["ns_coefficients"],
                                  group["eps"], group["ns_dtype"])
            step = -adjusted_lr(lr, shape, group["adjust_lr_fn"])
            # One multi-tensor add per stack, not one add per matrix; the cast first keeps
            # it on the kernels' fast path, which wants one dtype (exact: bf16 -> fp32).
            ortho = ortho.to(params[members[0]].dtype)
            torch._foreach_add_([params[i] for i in members], list(ortho.unbind()),
                                alpha=step)
