"""The training recipe: the defaults that make a run train at every size, from the
model's shape alone.

A run that gives no ``--lr``, ``--min-lr`` or ``--warmup`` takes them from here
(:func:`default_lr`, :func:`default_min_lr`, :func:`default_warmup`, filled in by
``TrainSettings.resolve``), and
:meth:`lab2_trainer.models.transformer.TransformerLM.reset_parameters`
initialises the weights with the standard deviations here (:func:`init_stds`).

**Learning rate: 0.4 / d_model.** GPT-3's table (Brown et al. 2020, table 2.1) gives a peak
learning rate per model size; its products ``lr × d_model`` lie between 0.31 and 0.51 from
125M to 13B parameters, so one constant over the width reproduces it within about 25%:
5.2e-4 at ``small``'s width 768 (GPT-3's 125M: 6.0e-4), 2.5e-4 at ``xl``'s 1,600 (GPT-3's
1.3B: 2.0e-4), 9.8e-5 at 4,096 (GPT-3's 6.7B: 1.2e-4). The width is also what μP scales
Adam's hidden-layer learning rate by. On ``small``, 1,000 steps of 32 × 512 bytes, twice
the rule ended 0.05 nats/byte worse than the rule itself (the record:
docs/benchmarks/2026-12-05-h100-defaults-sweep.md). The fixed default it replaces, 3e-3,
is 5.8 times the rule at ``small`` and 12 times it at ``xl``. GPT-3's table starts at
125M parameters; ``tiny`` (0.7 M) takes its own (:data:`PRESET_RUNS`).

**Optimizer and architecture.** Muon for the blocks' matrices (:data:`OPTIMIZER`,
:mod:`lab2_trainer.recipe.muon`), with rotary positions and QK-norm in the model
(``ModelConfig``'s defaults): together they reached a given loss on ``small`` after a third
of AdamW's tokens (the figures are at :data:`OPTIMIZER`). The learning-rate rule below is
AdamW's, for the tables, the head and the vectors; Muon takes the same schedule.

**Schedule.** Linear warm-up over 5% of the run (at least 20 steps, at most 500), then
cosine decay to a tenth of the peak, as GPT-3 did; AdamW with betas (0.9, 0.95) and weight
decay 0.1 on the matrices, not on the norms nor on the embedding tables (their scale is
the residual stream's, see below).

**Initialisation.** Pre-norm blocks divide the residual stream by its RMS before every
sub-layer, so the stream's scale sets how much every gradient that flows back through a
norm is amplified. GPT-2's N(0, 0.02) embeddings start the stream at an RMS of about 0.03:
the gradient norm at step 1 was 79 at ``small`` and 181 at ``xl``, and Adam's first
updates (about ``lr`` per element, whatever the gradient's size) move the depth-scaled
output projections (std 0.002 at ``xl``) by a large fraction of themselves in one
coherent direction, into a stream too small to absorb it: the loss jumped to 9-10 nats
within six steps at ``large`` and ``xl`` even at this rule's learning rate (15 at 3e-3).
Tables of N(0, 1), as Llama starts them, keep the stream at unit scale and the first
steps calm (gradient norm 4-7 at step 1, no rise at any preset), but Adam then moves them
by only ``lr`` of 1 a step: ``small`` ended 0.05 nats/byte worse after 1,000 steps than
with tables of N(0, 0.3). Small tables with a multiplier in the forward
(``ModelConfig.embed_scale``, as Gemma scales its embeddings) start the stream at unit RMS
and move by the same fraction of themselves each step as GPT-2's: ``tiny``'s main command
ended at 2.19 nats/byte with them, 2.37 with tables of N(0, 1). A stream that starts small
still learns faster where the model is shallow (``tiny`` with ``embed_scale`` 1: 1.81
against 2.03), but its step-1 gradient norm grows with width and depth (11 at ``tiny``'s
width, 43 at 48 layers of width 128, where the loss rose past ln 256 + 0.5 on the CPU): the
defaults start the stream at unit RMS at every preset. So:

* token and position tables: N(0, 0.02), their sum multiplied by 1 / (0.02 sqrt 2) =
  35.36 in the forward (unit RMS); no weight decay on them;
* every other matrix: N(0, 0.02); the projections that write into the residual stream
  (attention output, feed-forward down) N(0, 0.02 / sqrt(2 n_layers)), so the stream's
  variance does not grow with depth (GPT-2);
* the LM head: N(0, 0.5 / sqrt(d_model)), so that the logits start with a standard
  deviation of 0.5 (the loss at step 1 is about ln(vocab) + 0.125: near uniform). A head
  of 1 / d_model left ``small`` 0.19 nats/byte worse after 1,000 steps: the body's first
  gradients are proportional to it;
* a tied head and token table share one matrix: N(0, 0.02), GPT-2's logits.

The measurements: docs/benchmarks/2026-12-05-h100-defaults-sweep.md (GPU) and
docs/benchmarks/2026-12-05-cpu-2core-tiny-defaults.md (CPU).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from lab2_trainer.recipe.muon import muon_problem

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


#: Run defaults of the presets the rules above do not serve, applied by ``lab2-train`` (and
#: the benchmarks that run its defaults) where the command line does not give them.
#: ``tiny`` (0.7 M parameters, far below GPT-3's 125M) is the CPU main command's model: over
#: its 200 steps a learning rate of 6e-3 (0.77 / d_model) and 64 sequences of 64 bytes
#: (its preset's context) ended 0.25 nats/byte lower than 3.1e-3 and 32 x 128, in less
#: time (docs/benchmarks/2026-12-05-cpu-2core-tiny-defaults.md).
PRESET_RUNS: dict[str, dict[str, float | int | str]] = {"tiny": {"lr": 6e-3, "batch_size": 64}}
#: Model fields that make a preset another model: its own run defaults no longer apply.
SHAPE_FIELDS = frozenset({"d_model", "n_layers"})
#: The optimizer of every run that names none: Muon (:mod:`lab2_trainer.recipe.muon`) for
#: the blocks' matrices, AdamW for the rest. With rotary positions and QK-norm (the model's
#: defaults) it read 0.85 nats/byte on ``small`` after 6.8-7.2 M tokens, where AdamW with
#: learned positions and plain attention needed 23 M; at 450 steps it ended at 0.833
#: (three seeds: 0.839, 0.823, 0.837) against 1.398 (1.403, 1.383, 1.409), each step 1.5x
#: AdamW's on one H100 (docs/benchmarks/2026-12-06-h100-recipe-defaults.md). On the CPU
#: main command Muon ended at 1.578 against AdamW's 1.939, and with rope and QK-norm at
#: 1.416 (docs/benchmarks/2026-12-06-cpu-2core-muon.md). Where the layout cuts the
#: matrices (``--sharding fsdp``, ``--tp`` > 1) it gives way to AdamW.
OPTIMIZER = "muon"


def preset_run(preset: str, changed: Iterable[str] = (),
               given: Mapping[str, Any] | None = None) -> dict[str, float | int | str]:
    """The run defaults of ``preset`` that differ from :class:`TrainSettings`' own (a new
    dict): the recipe's :data:`OPTIMIZER`, and the preset's :data:`PRESET_RUNS`, none of
    which where ``changed`` (the model fields given over the preset's) names its width or
    depth, which the general rules serve. Muon is left out where the settings ``given``
    lay the ranks out so that they cut its matrices (``--sharding fsdp``, ``--tp`` > 1)."""
    run: dict[str, float | int | str] = {"optimizer": OPTIMIZER}
    if not SHAPE_FIELDS.intersection(changed):
        run.update(PRESET_RUNS.get(preset, {}))
    given = given or {}
    tp = given.get("tp")
    tp = tp if isinstance(tp, int) and not isinstance(tp, bool) else 1
    if muon_problem(str(run["optimizer"]), given.get("sharding"), tp) is not None:
        del run["optimizer"]
    return run


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
