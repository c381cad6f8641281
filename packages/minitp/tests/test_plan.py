"""Plans in one process: every refusal names what is wrong (``check_plan`` needs no process
group: it is given ``tp``), a refused plan changes nothing, and on a group of one rank a
parallelized model is the model. The input checks of the vocabulary layers, and the
communication records' arithmetic, are here too."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lab2_testing.modules import load_path
from minitp import (
    ColumnParallelLinear,
    ColwiseLinear,
    CommCounter,
    CommRecord,
    LocalHeads,
    PlanError,
    RowParallelLinear,
    RowwiseLinear,
    SequenceSplit,
    SharedInput,
    VocabEmbedding,
    VocabParallelEmbedding,
    check_plan,
    count_communication,
    llama_plan,
    parallelize,
    vocab_parallel_cross_entropy,
)

tp_models = load_path(Path(__file__).with_name("tp_models.py"), "minitp_tests_tp_models")
Block, TinyLM, build = tp_models.Block, tp_models.TinyLM, tp_models.build


@pytest.fixture
def one_rank(tmp_path):
    """A Gloo process group of this process alone."""
    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


class Twice(nn.Module):
    """One Linear registered under two names."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = self.a


REFUSALS = [
    # (model, plan, tp, what the message must say)
    (Block, {"nope.*": ColwiseLinear()}, 2, "'nope.*' matches no module of Block"),
    (Block, {"norm1": ColwiseLinear()}, 2,
     "module 'norm1' (LayerNorm): ColwiseLinear needs an nn.Linear"),
    (Block, {"attn.q_proj": ColwiseLinear()}, 5,
     "module 'attn.q_proj' (Linear): out_features = 24 does not split into 5 equal shards"),
    (Block, {"mlp.fc2": RowwiseLinear()}, 5,
     "module 'mlp.fc2' (Linear): in_features = 48 does not split into 5"),
    (Block, {"attn.k_proj": ColwiseLinear(multiple_of=24)}, 2,
     "of whole units of 24"),
    (Block, {"mlp.fc1": VocabEmbedding()}, 2, "VocabEmbedding needs an nn.Embedding"),
    (TinyLM, {"embed": VocabEmbedding(), "head": ColwiseLinear()}, 5,
     "module 'embed' (Embedding): num_embeddings = 36 does not split into 5"),
    (Block, {"attn": LocalHeads(("n_kv_heads",))}, 2, "Attention has no attribute 'n_kv_heads'"),
    (Block, {"attn": LocalHeads(("n_heads",))}, 5, "n_heads = 12 does not split into 5"),
    (Block, {"mlp.fc1": ColwiseLinear(), "mlp.fc*": RowwiseLinear()}, 2,
     "module 'mlp.fc1' gets two replacing styles: ColwiseLinear, RowwiseLinear"),
    (Block, {"mlp.fc1": ColwiseLinear(), "mlp.fc[1]": ColwiseLinear()}, 2,
     "module 'mlp.fc1' gets ColwiseLinear from both 'mlp.fc1' and 'mlp.fc[1]'"),
    (Block, {"mlp.fc1": (ColwiseLinear(), SequenceSplit())}, 2,
     "module 'mlp.fc1' is replaced (ColwiseLinear); it cannot also get SequenceSplit"),
    (Block, {"mlp": SharedInput(), "mlp.fc2": RowwiseLinear()}, 2,
     "module 'mlp' has SharedInput but no ColwiseLinear inside it"),
    (TinyLM, {"embed": VocabEmbedding()}, 2,
     "parameter embed.weight is shared with head.weight (not sharded)"),
    (TinyLM, {"embed": VocabEmbedding(), "head": RowwiseLinear()}, 2,
     "shared with head.weight (RowwiseLinear)"),
    (Block, {"mlp.fc1": "column"}, 2, "'column' is not a style"),
    (Block, {"mlp.fc1": ()}, 2, "plan entry 'mlp.fc1' has no style"),
    (Block, {3: ColwiseLinear()}, 2, "plan keys are module-name patterns"),
    (Block, [("mlp.fc1", ColwiseLinear())], 2, "a plan is a mapping"),
    (Twice, {"a": ColwiseLinear()}, 2, "module 'a' is also registered as ['b']"),
    (lambda: nn.Linear(4, 4), {"": ColwiseLinear()}, 2, "replaces the model itself"),
]


@pytest.mark.parametrize("make, plan, tp, message", REFUSALS,
                         ids=[r[3][:40] for r in REFUSALS])
def test_refusals_name_what_is_wrong(make, plan, tp, message):
    model = make()
    with pytest.raises(PlanError) as err:
        check_plan(model, plan, tp)
    assert message in str(err.value)


def test_check_plan_lists_each_module_once_in_model_order():
    styles = check_plan(TinyLM(), tp_models.lm_plan(), 4)
    names = list(styles)
    assert names[0] == "embed" and names[-1] == "head"
    assert styles["blocks.1.attn"] == (SharedInput(), LocalHeads(("n_heads",)))
    assert styles["blocks.0.attn.v_proj"] == (ColwiseLinear(multiple_of=2),)
    assert len([n for n in names if n.endswith("norm1")]) == 2


def test_a_refused_plan_changes_nothing(one_rank):
    model = build(TinyLM)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(PlanError, match="'missing' matches no module"):
        parallelize(model, {**tp_models.lm_plan(), "missing": SequenceSplit()})
    assert type(model.blocks[0].attn.q_proj) is nn.Linear
    assert model.blocks[0].attn.n_heads == tp_models.HEADS
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_one_rank_parallelize_is_the_model(one_rank):
    full = build(TinyLM)
    model = parallelize(build(TinyLM), tp_models.lm_plan(), sequence_parallel=True)
    assert isinstance(model.embed, VocabParallelEmbedding)
    assert isinstance(model.blocks[1].attn.o_proj, RowParallelLinear)
    assert isinstance(model.head, ColumnParallelLinear)
    assert model.head.weight is model.embed.weight
    ids = torch.randint(0, tp_models.VOCAB, (2, 12))
    # The row layers add their bias after the matmul: rounding apart, the same.
    assert tp_models.rel_err(model(ids), full(ids)) < tp_models.TOL
    targets = torch.randint(0, tp_models.VOCAB, (2, 12))
    loss = vocab_parallel_cross_entropy(model(ids), targets)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(
        full(ids).flatten(0, 1), targets.flatten()))


def test_shared_input_takes_the_keyword_argument(one_rank):
    class ByKeyword(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, hidden_states=None, other=None):
            return self.proj(hidden_states if hidden_states is not None else other)

    model = parallelize(nn.Sequential(ByKeyword()),
                        {"0": SharedInput(), "0.proj": ColwiseLinear()})
    x = torch.randn(3, 4)
    torch.testing.assert_close(model[0](hidden_states=x), model[0].proj(x))
    with pytest.raises(TypeError, match="SharedInput on '0': called with neither"):
        model[0](other=x)


def test_llama_plan_names_and_head_dim():
    config = SimpleNamespace(hidden_size=64, num_attention_heads=4, head_dim=None)
    plan = llama_plan(config)
    assert plan["model.layers.*.self_attn.[qkv]_proj"] == ColwiseLinear(multiple_of=16)
    assert plan["model.layers.*.self_attn.o_proj"] == RowwiseLinear(multiple_of=16)
    assert plan["lm_head"] == ColwiseLinear()
    assert plan["model.embed_tokens"] == VocabEmbedding()
    bare = llama_plan(SimpleNamespace(head_dim=8), prefix="", head="", gather_logits=True)
    assert "lm_head" not in bare and "layers.*.mlp" in bare
    assert llama_plan(config, gather_logits=True)["lm_head"] == ColwiseLinear(
        gather_output=True)


def test_vocab_inputs_are_checked(one_rank):
    logits = torch.randn(2, 3, 7)
    targets = torch.randint(0, 7, (2, 3))
    with pytest.raises(ValueError, match="reduction must be"):
        vocab_parallel_cross_entropy(logits, targets, reduction="avg")
    with pytest.raises(ValueError, match=r"local_logits \(2, 3, 7\) and targets \(2, 4\)"):
        vocab_parallel_cross_entropy(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"targets holds 7, outside \[0, 7\)"):
        vocab_parallel_cross_entropy(logits, torch.full((2, 3), 7))
    with pytest.raises(TypeError, match="targets must be integers"):
        vocab_parallel_cross_entropy(logits, targets.double())
    embedding = VocabParallelEmbedding(10, 4)
    with pytest.raises(ValueError, match=r"token ids holds -1, outside \[0, 10\)"):
        embedding(torch.tensor([[1, -1]]))
    with pytest.raises(ValueError, match="does not support"):
        VocabParallelEmbedding.from_embedding(nn.Embedding(10, 4, max_norm=1.0))
    with pytest.raises(TypeError, match="needs an nn.Linear"):
        ColumnParallelLinear.from_linear(nn.Embedding(10, 4))


def test_one_rank_communicates_nothing(one_rank):
    model = parallelize(build(Block), tp_models.block_plan(), sequence_parallel=True)
    x = torch.randn(2, 12, tp_models.D, dtype=tp_models.DTYPE, requires_grad=True)
    with count_communication() as counter:
        model(x).sum().backward()
    assert counter.records == []


def test_ring_bytes_arithmetic():
    counter = CommCounter([CommRecord("all_reduce", "forward", (2, 3), 48, 4),
                           CommRecord("all_gather", "backward", (2, 3), 48, 4),
                           CommRecord("reduce_scatter", "backward", (2, 3), 48, 4)])
    assert counter.ring_bytes("all_reduce") == 2 * 3 / 4 * 48
    assert counter.ring_bytes(phase="backward") == 2 * 3 / 4 * 48
    assert counter.total_bytes() == 3 * 48
    assert len(counter.select(shape=(2, 3))) == 3
