"""Property: for drawn architectures, bucket caps and uneven batch splits, every
variant's distributed training equals single-process training.

Hypothesis draws in the pytest process and hands the drawn configuration to the
ranks, so all ranks run the same example.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lab2_testing import ddp_testkit as kit
from lab2_testing import rank_programs as programs
from lab2_testing import run_ranks


@st.composite
def configs(draw, world_size: int) -> dict:
    widths = tuple(draw(st.lists(st.integers(1, 6), min_size=2, max_size=4)))
    layers = len(widths) - 1
    # Freeze a layer only when another one stays trainable (else the loss has no graph).
    frozen_layer = None if layers == 1 else draw(st.one_of(st.none(), st.integers(0, layers - 1)))
    # Slices may be empty: such a rank still joins every collective.
    split = draw(st.lists(st.integers(0, 3), min_size=world_size, max_size=world_size))
    if sum(split) == 0:
        split[draw(st.integers(0, world_size - 1))] = 1
    cap_bytes = draw(st.one_of(st.none(), st.integers(1, 600)))
    return {
        "model_kwargs": {"widths": widths, "frozen_layer": frozen_layer},
        "split": split,
        "bucket_size_mb": None if cap_bytes is None else cap_bytes / 2**20,
        "seed": draw(st.integers(0, 10_000)),
    }


@settings(max_examples=4)  # each example spawns the ranks: seconds apiece
@given(data=st.data())
def test_drawn_models_and_splits_match_single_process_training(world_size, data):
    config = data.draw(configs(world_size))
    want = kit.train_reference(
        "mlp", sum(config["split"]), programs.PROPERTY_STEPS, config["seed"], config["model_kwargs"]
    )
    results = run_ranks(programs.property_rank, world_size, config, timeout=90)
    for rank, per_rank in enumerate(results):
        for variant, got in per_rank.items():
            kit.assert_matches(got, want, f"{variant} rank {rank}/{world_size} {config}")
