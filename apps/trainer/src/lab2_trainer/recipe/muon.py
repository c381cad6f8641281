"""Muon in the recipe (``--optimizer muon``): which parameters it steps, its learning rate,
and the layouts it cannot run on. No torch.

**What it steps.** Muon (``zero1.Muon``) steps a matrix with its momentum orthogonalised
by five Newton-Schulz iterations (the singular values pushed towards 1), so every
direction of the update moves by about the same amount whatever the gradient's spectrum.
That suits the hidden layers' weight matrices: the blocks' ``qkv``, ``proj`` and the
feed-forward's ``w1``, ``w2`` (and ``w3``), each orthogonalised whole (``qkv`` as one
matrix). The embedding tables (a lookup, not a linear map of the stream), the LM head (its
rows are the vocabulary's logits) and the vectors (norm weights, biases) stay with AdamW,
under ``--lr``'s rule and schedule (:mod:`lab2_trainer.recipe.defaults`).

**Learning rate.** ``--muon-lr`` follows ``--lr``'s schedule (the same warm-up and cosine,
its own peak), with Muon's momentum 0.95 (Nesterov) and decoupled weight decay
``W ← W(1 - γλ)`` at ``--weight-decay``, as AdamW's on the matrices. Each matrix's step is
``γ · max(1, rows/cols)**0.5`` times the orthogonalised momentum (``adjust_lr_fn``
"original", torch.optim.Muon's default): an orthogonal update of spectral norm about γ,
whatever the width, so that one γ serves every width.

MEASUREMENTS
"""

from __future__ import annotations

#: The optimizers a run can take (``--optimizer``).
OPTIMIZERS = ("adamw", "muon")
#: Muon's momentum and Nesterov look-ahead (torch.optim.Muon's defaults).
MOMENTUM = 0.95
NESTEROV = True
#: How a matrix's shape scales Muon's learning rate (``zero1.muon.adjusted_lr``).
ADJUST_LR_FN = "original"
#: Muon's peak learning rate (a fit: see the module docstring).
MUON_LR = 0.05


def default_muon_lr(d_model: int) -> float:
    """Muon's peak learning rate for a model of width ``d_model``: :data:`MUON_LR` at every
    width (the "original" scale keeps the update's spectral norm at the rate)."""
    del d_model
    return MUON_LR


def muon_problem(optimizer: str, sharding: str | None, tp: int) -> str | None:
    """What keeps ``--optimizer muon`` from running correctly on this layout, in one line
    naming the flag; None: nothing (or another optimizer). Newton-Schulz needs each matrix
    whole: tensor parallelism cuts every block matrix, FSDP2 keeps rows of it per rank as
    DTensor shards. zero1's stages 1-3 and the broadcasting kinds step whole matrices on
    owner ranks."""
    if optimizer != "muon":
        return None
    if tp > 1:
        return (f"--optimizer muon cannot run with --tp {tp}: Newton-Schulz orthogonalises "
                "whole matrices, which tensor parallelism cuts (use --tp 1)")
    if sharding == "fsdp":
        return ("--optimizer muon cannot run with --sharding fsdp: Newton-Schulz "
                "orthogonalises whole matrices, which FSDP2 cuts into row shards (--sharding "
                "zero3 shards the same way and steps each matrix whole on one rank)")
    return None
