"""What the smoke tests of minddp and zero1 share: a one-rank Gloo group, and a small model
with a bare copy of it to compare against.

The smoke scripts run from this folder (``python testing/smoke/smoke_<member>.py``), so
they import this module by its plain name.
"""

import contextlib
import copy
import tempfile
from collections.abc import Iterator

import torch
import torch.distributed as dist


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """A Gloo process group of one rank, rendezvous in a temporary file."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0,
                                world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def model_and_bare_copy() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A seeded two-layer MLP (8 -> 16 -> 1) and an independent copy of it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    return model, copy.deepcopy(model)
