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
"original", torch.optim.Muon's default): an orthogonal update of spectral norm about γ
whatever the width, so that one γ can serve every width. The other common rule,
"match_rms_adamw" (``0.2 · max(rows, cols)**0.5``, the update's RMS matched to AdamW's),
grows the step with the square root of the width at a fixed γ.

Measured on the CPU (2 Gloo ranks, zero1; the main command's shape, ``tiny``'s depth 3, 4
heads, ``d_ff`` 3 d_model, context 64, 64 sequences a step, 200 steps, seed 0; AdamW's
``--lr`` at 0.768 / d_model, tiny's 6e-3 at its width; final validation loss, nats/byte;
one run each, deterministic):

========  ======  ======  ======  ======  ======
d_model   γ 0.025 γ 0.05  γ 0.07  γ 0.1   γ 0.2
========  ======  ======  ======  ======  ======
64        1.936   1.745           1.704   1.889
128       1.762   1.578   1.577   1.647
256       1.574   1.435           1.526
========  ======  ======  ======  ======  ======

With "original", γ = 0.05 was the best (or within 0.001 of it) at widths 128 and 256, a
factor of two apart; at 64 the best was 0.1. "match_rms_adamw" at width 128 was best at
γ = 0.022 (1.720, 1.586, 1.713 at 0.011, 0.022, 0.044), where its steps are those of
"original" at 0.05 but for ``w2``'s, 1.7 times larger: 0.008 worse than "original" at
0.05. Its γ could not carry to another width: matching these steps at 256 takes 0.016, at
64 0.031 (a rule in 1 / sqrt(width)). So the rule is "original" with one rate,
:data:`MUON_LR` = 0.05, a fit on these CPU runs; beyond width 256, on other data, on longer
runs and on the GPU it is untested (no GPU run chose it). On the main command itself
(width 128) AdamW alone ends at 1.939.
"""

from __future__ import annotations

#: The optimizers a run can take (``--optimizer``).
OPTIMIZERS = ("adamw", "muon")
#: Muon's momentum and Nesterov look-ahead (torch.optim.Muon's defaults).
MOMENTUM = 0.95
NESTEROV = True
#: How a matrix's shape scales Muon's learning rate (``zero1.muon.adjusted_lr``).
ADJUST_LR_FN = "original"
#: Muon's peak learning rate at every width (a fit on CPU runs of widths 64-256: see the
#: module docstring).
MUON_LR = 0.05


def default_muon_lr(d_model: int) -> float:
    """Muon's peak learning rate for a model of width ``d_model``: :data:`MUON_LR` at every
    width (the "original" shape factor keeps the update's spectral norm at the rate; the
    best rate measured was the same at widths 128 and 256)."""
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
