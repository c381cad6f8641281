"""The trainer's own state (``trainer.pt`` of a step folder) for tests that save a model
and optimizer through the real ``Checkpointer`` without running the training loop."""

from __future__ import annotations

from typing import Any

import torch


def bare_trainer_state(settings: Any, optimizer: torch.optim.Optimizer, step: int,
                       world_size: int = 1) -> dict[str, Any]:
    """What ``checkpoint.folders`` writes beside the parts, for a run at ``step`` with
    ``settings`` and ``optimizer``: an empty schedule and corpus identity, the sampler at
    ``step`` draws, the CPU's random state, no scaler and no learned gradient order."""
    from lab2_trainer.checkpoint.rng import rng_state
    from lab2_trainer.checkpoint.single_file import FORMAT, VERSION
    from zero1.checkpoint import pack_param_groups

    return {"format": FORMAT, "version": VERSION, "sharded": True,
            "model_config": settings.model.to_dict(), "settings": settings.to_dict(),
            "optimizer_groups": pack_param_groups(optimizer.param_groups), "schedule": {},
            "step": step, "sampler": {"seed": 0, "draws": step}, "data": {},
            "rng": rng_state(torch.device("cpu")), "scaler": None, "world_size": world_size,
            "gradient_order": None}


def same_model_and_optimizer(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two whole checkpoints (``lab2-train export``'s or a single file's layout:
    ``model`` and ``optimizer`` state dicts) hold the same model and optimizer state bit
    for bit."""
    if a["model"].keys() != b["model"].keys() or any(
            not torch.equal(a["model"][k], b["model"][k]) for k in a["model"]):
        return False
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    return sa.keys() == sb.keys() and all(
        torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
