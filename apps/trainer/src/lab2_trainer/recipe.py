"""The training recipe: the defaults that make a run train at every size, from the
model's shape alone.

A run that gives no ``--lr``, ``--min-lr`` or ``--warmup`` takes them from here
(:func:`default_lr`, :func:`default_min_lr`, :func:`default_warmup`, filled in by
``TrainSettings.resolve``), and :meth:`lab2_trainer.model.TransformerLM.reset_parameters`
initialises the weights with the standard deviations here (:func:`init_stds`).

**Learning rate: 0.4 / d_model.** GPT-3's table (Brown et al. 2020, table 2.1) gives a peak
learning rate per model size; its products ``lr × d_model`` lie between 0.31 and 0.51 from
125M to 13B parameters, so one constant over the width reproduces it within about 25%:
5.2e-4 at ``small``'s width 768 (GPT-3's 125M: 6.0e-4), 2.5e-4 at ``xl``'s 1,600 (GPT-3's
1.3B: 2.0e-4), 9.8e-5 at 4,096 (GPT-3's 6.7B: 1.2e-4). The width is also what μP scales
Adam's hidden-layer learning rate by. On ``small``, 1,000 steps of 32 × 512 bytes, twice
the rule ended 0.05 nats/byte worse than the rule itself (the record:
docs/benchmarks/2026-12-05-h100-defaults-sweep.md). The fixed default it replaces, 3e-3,
is 5.8 times the rule at ``small`` and 12 times it at ``xl``.

**Schedule.** Linear warm-up over 5% of the run (at least 20 steps, at most 500), then
cosine decay to a tenth of the peak, as GPT-3 did; AdamW with betas (0.9, 0.95) and weight
decay 0.1 on the matrices, not on the norms nor on the embedding tables (their scale is
the residual stream's, see below).

**Initialisation.** Pre-norm blocks divide the residual stream by its RMS before every
sub-layer, so the stream's scale sets how much every gradient that flows back through a
norm is amplified. GPT-2's N(0, 0.02) embeddings start the stream at an RMS of about 0.03:
the gradient norm at step 1 was 74 at ``small`` and 181 at ``xl``, and Adam's first
updates (about ``lr`` per element, whatever the gradient's size) then move the
depth-scaled output projections (std 0.002 at ``xl``) by a large fraction of themselves in
one coherent direction, into a stream too small to absorb it: the loss jumped to 9-15
nats within six steps even at the rule's learning rate. So:

* token and position embeddings: N(0, 1), as Llama and torchtitan start them: the stream
  starts at unit scale, and the step-1 gradient norm is 4-7 at every preset;
* every other matrix: N(0, 0.02); the projections that write into the residual stream
  (attention output, feed-forward down) N(0, 0.02 / sqrt(2 n_layers)), so the stream's
  variance does not grow with depth (GPT-2);
* the LM head: N(0, 0.5 / sqrt(d_model)), so that the logits start with a standard
  deviation of 0.5 (the loss at step 1 is about ln(vocab) + 0.125: near uniform). A head
  much smaller than that (1 / d_model) left ``small`` 0.19 nats/byte worse after 1,000
  steps: the body's gradients are proportional to it.
* a tied head and embedding share one matrix: it takes the head's standard deviation
  (near-uniform logits matter more than the stream's starting scale).
"""

from __future__ import annotations

import math

#: Peak learning rate times d_model (the GPT-3 table's products lie in 0.31-0.51).
LR_TIMES_WIDTH = 0.4
#: The final learning rate as a fraction of the peak.
MIN_LR_FRACTION = 0.1
#: Warm-up as a fraction of the run, and its bounds in steps.
WARMUP_FRACTION = 0.05
WARMUP_BOUNDS = (20, 500)
#: Standard deviations of the initialisation (see the module's docstring).
EMBEDDING_STD = 0.02
MATRIX_STD = 0.02
LOGIT_STD = 0.5
#: The embedding's multiplier in the forward: token plus position tables of std 0.02 sum
#: to a stream of unit RMS.
EMBED_SCALE = round(1.0 / (EMBEDDING_STD * math.sqrt(2.0)), 2)


def default_lr(d_model: int) -> float:
    """The peak learning rate for a model of width ``d_model``: 0.4 / d_model."""
    return LR_TIMES_WIDTH / d_model


def default_min_lr(lr: float) -> float:
    """The final learning rate of the cosine decay: a tenth of the peak."""
    return lr * MIN_LR_FRACTION


def default_warmup(steps: int) -> int:
    """Warm-up steps for a run of ``steps``: 5% of it, at least 20 and at most 500 (never
    more than the run)."""
    low, high = WARMUP_BOUNDS
    return min(steps, max(low, min(high, round(steps * WARMUP_FRACTION))))


def init_stds(d_model: int, n_layers: int, tied: bool = False) -> dict[str, float]:
    """The initialisation's standard deviations by role: ``embedding``, ``matrix``,
    ``residual`` (projections into the residual stream) and ``head``."""
    head = EMBEDDING_STD if tied else LOGIT_STD / math.sqrt(d_model)
    return {"embedding": EMBEDDING_STD, "matrix": MATRIX_STD,
            "residual": MATRIX_STD / math.sqrt(2 * n_layers), "head": head}
