"""Model FLOPs utilisation: the FLOPs a training step must do, over what the GPU could do.

FLOPs per token of a training step (forward and backward), as in the PaLM paper's
appendix B:

    6 * N  +  12 * n_layers * d_model * context_length

``N`` counts the parameters that take part in a matrix product: every parameter except
the two embedding tables, which are lookups; the LM head counts, once even when tied to
the token table. The second term is attention's own products (scores and the weighted sum
of values), which have no parameters. A forward alone is a third of both terms. Recomputed
activations, the optimizer and the norms are not counted: MFU measures useful work.

The peak is the GPU's dense bf16 tensor throughput from the table below, found by the
device's name; on the CPU or an unknown GPU there is no peak, and MFU is reported as absent
rather than guessed.

Hardware FLOPs utilisation (HFU) counts what the GPU really computes, recomputation
included: with activation checkpointing, the recomputed blocks' forward matrix products
(``2 * N_block + 4 * d_model * context_length`` per block and token) are added to the
model FLOPs (:func:`recompute_flops_per_token`). Without recomputation HFU equals MFU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lab2_trainer.config import ModelConfig


@dataclass(frozen=True)
class Peak:
    """A device's dense bf16 peak: its name in reports and FLOP/s."""

    name: str
    flops: float


#: Dense (no sparsity) bf16 tensor-core peaks, from the vendors' data sheets, matched as
#: substrings of ``torch.cuda.get_device_name()``, first match wins (the more specific
#: names come first).
PEAKS: list[tuple[str, Peak]] = [
    ("H100 PCIe", Peak("NVIDIA H100 PCIe, dense bf16", 756e12)),
    ("H100 NVL", Peak("NVIDIA H100 NVL, dense bf16", 835e12)),
    ("H200", Peak("NVIDIA H200 SXM, dense bf16", 989e12)),
    ("H100", Peak("NVIDIA H100 SXM, dense bf16", 989e12)),
    ("H800", Peak("NVIDIA H800 SXM, dense bf16", 989e12)),
    ("B200", Peak("NVIDIA B200, dense bf16", 2250e12)),
    ("A100", Peak("NVIDIA A100, dense bf16", 312e12)),
    ("A800", Peak("NVIDIA A800, dense bf16", 312e12)),
    ("L40S", Peak("NVIDIA L40S, dense bf16", 362e12)),
]


def peak_for_name(name: str) -> Peak | None:
    """The table's peak for a device name, or None when the name is not in it."""
    for key, peak in PEAKS:
        if key in name:
            return peak
    return None


def device_peak(device: torch.device | str) -> Peak | None:
    """The dense bf16 peak of ``device``: None on the CPU or on a GPU not in :data:`PEAKS`."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_for_name(torch.cuda.get_device_name(device))


def device_label(device: torch.device | str) -> str:
    """The device's name as reports show it ("cpu", or the GPU's name)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type


def matmul_parameters(model: nn.Module) -> int:
    """Parameters taking part in matrix products (``N`` above) of a ``TransformerLM``."""
    total = sum(p.numel() for p in model.parameters())  # a tied weight comes once
    total -= model.pos_emb.weight.numel()
    if model.lm_head.weight is not model.tok_emb.weight:
        total -= model.tok_emb.weight.numel()
    return total


def training_flops_per_token(config: ModelConfig, n_matmul_params: int) -> float:
    """FLOPs of one token's forward and backward (see the module docstring)."""
    attention = 12 * config.n_layers * config.d_model * config.context_length
    return 6 * n_matmul_params + attention


def block_matmul_parameters(config: ModelConfig) -> int:
    """Parameters of one decoder block's matrix products (attention's four projections and
    the feed-forward's two or three matrices)."""
    ffn = 3 if config.ffn == "swiglu" else 2
    return 4 * config.d_model * config.d_model + ffn * config.d_model * config.d_ff


def recompute_flops_per_token(config: ModelConfig, activation_checkpointing: str) -> float:
    """Forward FLOPs per token that activation checkpointing runs again in backward: the
    recomputed blocks' matrix products and attention products (none for "none" and for
    the op-level "selective" policy, which recomputes only elementwise work)."""
    from lab2_trainer.model import recomputed_blocks

    blocks = recomputed_blocks(activation_checkpointing, config.n_layers)
    per_block = 2 * block_matmul_parameters(config) + 4 * config.d_model * config.context_length
    return float(blocks * per_block)


def mfu(tokens_per_s: float, flops_per_token: float, peak: Peak | None,
        devices: int = 1) -> float | None:
    """The fraction of ``devices`` x the peak that ``tokens_per_s`` uses; None without a peak.

    Args:
        tokens_per_s: tokens processed per second over all devices.
        flops_per_token: from :func:`training_flops_per_token` (a third of it for forwards).
        peak: the device's peak (None gives None).
        devices: how many devices shared the tokens.
    """
    if peak is None or not tokens_per_s > 0:
        return None
    return tokens_per_s * flops_per_token / (peak.flops * devices)
