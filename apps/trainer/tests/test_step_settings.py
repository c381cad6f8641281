"""Step settings: which thread runs backward, and how the bucket size cuts buckets."""

from __future__ import annotations

import threading

import pytest
import torch

from lab2_trainer.cli.main import build_parser
from lab2_trainer.config import UsageError
from lab2_trainer.training.step import backward_thread


def test_caller_turns_autograd_workers_off_for_this_thread_only():
    before = torch._C._is_multithreading_enabled()
    seen = {}
    with backward_thread("caller"):
        assert not torch._C._is_multithreading_enabled()
        other = threading.Thread(
            target=lambda: seen.setdefault("other", torch._C._is_multithreading_enabled()))
        other.start()
        other.join(timeout=10)
        with backward_thread("autograd"):
            assert torch._C._is_multithreading_enabled()
        assert not torch._C._is_multithreading_enabled()
    assert torch._C._is_multithreading_enabled() == before
    assert seen["other"]  # thread-local: another thread keeps PyTorch's default


def test_gradients_do_not_depend_on_the_thread():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    grads = []
    for kind in ("autograd", "caller"):
        model.zero_grad(set_to_none=True)
        with backward_thread(kind):
            model(x).square().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_unknown_thread_is_refused():
    with pytest.raises(ValueError, match="backward_thread"):
        backward_thread("main")


def test_flag_takes_the_two_choices():
    parser = build_parser()
    assert parser.parse_args(["--backward-thread", "autograd"]).backward_thread == "autograd"
    with pytest.raises(UsageError, match="--backward-thread"):  # one line, not the usage
        parser.parse_args(["--backward-thread", "main"])


def test_bucket_rules_are_minddps():
    # config.py takes minddp's rules; minddp's top level reads them without torch.
    import minddp
    from lab2_trainer.config import BUCKET_RULES, TrainSettings

    assert BUCKET_RULES is minddp.BUCKET_RULES
    assert TrainSettings().bucket_rule == "reach"
