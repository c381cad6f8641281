"""What rotary positions and QK-norm (``ModelConfig.rope``, ``qk_norm``, the model's
defaults) add to the activations a block keeps for its backward: :func:`qk_activation_bytes`,
which :func:`lab2_trainer.planner.plan.layer_activation_bytes` adds to attention's count.
Arithmetic on the shape; no torch.
"""

from __future__ import annotations

from lab2_trainer.config import ModelConfig


def qk_activation_bytes(config: ModelConfig, a: int, compiled: bool = False) -> float:
    """Bytes per token that rotary positions and QK-norm add to what a block keeps for its
    backward with no checkpointing (``models.transformer``'s ``rotate`` and
    ``rms_normalise``, whose autograd nodes are what keeps them; ``a`` the autocast dtype's
    size, 4 in fp32, :data:`lab2_trainer.planner.plan.ACTIVATION_BYTES`):

    * plain attention takes q, k and v as views of the qkv product, so its three inputs are
      that one tensor (3 a d, counted in
      :func:`lab2_trainer.planner.plan.layer_activation_bytes`). With either
      option q and k are new tensors that attention keeps (2 a d); v still keeps the
      whole qkv product alive;
    * the rotation keeps nothing that grows with the batch: its products of q's halves by
      the cosines and sines keep only those tables (positions x head_dim, slices of the
      model's table; negligible, and not counted), and the concatenation and the casts keep shapes.
      But its concatenation writes q in (batch, heads, positions) order, where the views of
      the qkv product are in (batch, positions, heads) order, and attention's output takes
      q's order: the ``transpose(1, 2).reshape`` before the output projection is then a
      copy, which the projection keeps beside the output attention keeps (a d more);
      QK-norm's elementwise ops keep q's order, so without the rotation that is a view;
    * QK-norm (``wide * rsqrt(mean(wide ** 2) + eps)``, ``wide`` q or k in fp32) keeps
      ``wide`` (the square's and the product's input) and the reciprocal RMS (4 bytes a
      head, the product's other input), for q and for k: 2 (4 d + 4 heads). In fp32
      ``wide`` is q itself, a view of the qkv product already counted: only the 8 bytes
      a head remain. Under autocast it is a cast copy: 8 d more.

    Rope alone: 3 a d. QK-norm alone: 2 a d + 8 heads + (8 d where ``a`` < 4); before the
    rotation (whose input it makes, and which keeps none of it), the default, both:
    3 a d + 8 heads + (8 d where ``a`` < 4). Compiled, Inductor's partitioner recomputes the
    fp32 copies from the qkv product it keeps anyway, and keeps the rest: the 8 d go.
    Measured on the CPU: eager in ``tests/test_planner.py`` (exact for every combination);
    compiled, the default model's blocks over the plain model's, by the difference of 2-
    and 3-block models at two batch sizes: 3 a d + 8 heads, in fp32 and in bf16. With
    ``selective`` checkpointing the policy recomputes all of it (none is a matrix
    product's or attention's output); with ``full`` the block keeps its inputs alone.
    Every term is per head: 1/tp under tensor parallelism (the caller divides).
    """
    if not (config.rope or config.qk_norm):
        return 0.0
    d = config.d_model
    extra = 2.0 * a * d  # the new q and k that attention keeps
    if config.rope:
        extra += a * d  # attention's output in q's order: the projection's input a copy
    if config.qk_norm:
        extra += 2 * 4 * config.n_heads  # the reciprocal RMS of each head, q's and k's
        if a < 4 and not compiled:
            extra += 2 * 4 * d  # q's and k's fp32 copies
    return extra
