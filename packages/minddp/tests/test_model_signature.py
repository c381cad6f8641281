"""Model signatures and the description of their first difference (no process group)."""

from __future__ import annotations

from torch import nn

from minddp.model_check import first_mismatch, model_signature


def _model() -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    return model


def test_signature_lists_parameters_then_buffers_with_shapes_dtypes_and_flags():
    sig = model_signature(_model())
    assert sig[0] == ("param", "0.weight", (4, 3), "torch.float32", False)
    assert sig[2] == ("param", "1.weight", (4,), "torch.float32", True)
    assert ("buffer", "1.num_batches_tracked", (), "torch.int64", False) in sig
    assert [e[0] for e in sig] == ["param"] * 6 + ["buffer"] * 3


def test_tied_parameters_appear_once():
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    assert [e[1] for e in model_signature(model)] == ["0.weight"]


def test_first_mismatch_names_the_first_difference():
    a = model_signature(_model())
    assert first_mismatch(a, a) is None
    b = model_signature(_model().double())
    assert "'0.weight'" in first_mismatch(a, b) and "torch.float64" in first_mismatch(a, b)
    shorter = a[:-1]
    assert "the list ended" in first_mismatch(a, shorter)
    unfrozen = _model()
    unfrozen.requires_grad_(True)
    assert "requires_grad=True" in first_mismatch(a, model_signature(unfrozen))
