"""minitp under ``torch.compile`` on Gloo ranks: each layer, mapping and a sharded block
compiled (dynamo, then AOTAutograd's ``aot_eager``: the traced forward and backward
graphs run op by op, no C compiler) against the same thing eager, float64: output, input
gradients and every parameter gradient.

No graph breaks: everything compiles with ``fullgraph=True`` (dynamo raises at any
break), with and without sequence parallelism, on the native collectives and on the
fallbacks; the embedding's and the loss's id checks become assertions in the graph, which
still refuse a bad id. The compiled forward and backward graphs hold the functional
collectives (the column layer's backward: its reduction started before the weight
gradient's product and waited for after it), and ``count_communication`` records nothing
from them.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch._dynamo
from torch import nn

from lab2_testing.dist import run_ranks
from lab2_testing.modules import load_path
from minitp import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_region,
    count_communication,
    fallback_collectives,
    gather_from_region,
    gather_from_sequence,
    parallelize,
    reduce_from_region,
    reduce_scatter_to_sequence,
    split_to_region,
    split_to_sequence,
    vocab_parallel_cross_entropy,
)

tp_models = load_path(Path(__file__).with_name("tp_models.py"), "minitp_tests_tp_models")
B, T, D, VOCAB, DTYPE = tp_models.B, tp_models.T, tp_models.D, tp_models.VOCAB, tp_models.DTYPE
rel_err = tp_models.rel_err
BACKEND = "aot_eager"


def _run(make, inputs, upstream, compiled: bool, fullgraph: bool = True):
    """``make()``'s module or function on fresh leaves of ``inputs`` (floating ones record
    gradients), forward and backward against ``upstream``: output, input gradients and
    parameter gradients. Compiled: a fresh dynamo cache, so every case traces anew."""
    target = make()
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(target, backend=BACKEND, fullgraph=fullgraph)
    else:
        fn = target
    xs = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    y = fn(*xs)
    (y.double() * upstream).sum().backward()
    params = target.named_parameters() if isinstance(target, nn.Module) else ()
    return (y.detach(), [x.grad for x in xs if x.is_floating_point()],
            {n: p.grad for n, p in params})


def _compare(make, inputs, upstream, fullgraph: bool = True) -> dict[str, float]:
    """Errors of the compiled run against the eager one."""
    want = _run(make, inputs, upstream, compiled=False)
    got = _run(make, inputs, upstream, compiled=True, fullgraph=fullgraph)
    errors = {"y": rel_err(got[0].double(), want[0].double())}
    for i, (g, w) in enumerate(zip(got[1], want[1])):
        errors[f"dx{i}"] = rel_err(g.double(), w.double())
    for name, w in want[2].items():
        errors[f"d{name}"] = rel_err(got[2][name].double(), w.double())
    return errors


def _randn(seed: int, *shape: int, dtype=DTYPE) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _linear(seed: int, d_in: int, d_out: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(d_in, d_out).to(DTYPE)


def _sharded_block(sp: bool) -> nn.Module:
    return parallelize(tp_models.build(tp_models.Block, seed=11), tp_models.block_plan(),
                       sequence_parallel=sp)


def compile_rank(rank: int, world: int) -> dict:
    errors: dict[str, float] = {}
    notes: dict = {}

    def add(case: str, errs: dict[str, float]) -> None:
        errors.update({f"{case}:{k}": v for k, v in errs.items()})

    local_t = T // world
    for sp in (False, True):
        x_in = _randn(1, B, local_t if sp else T, D)
        # Column layer: the output sharded, overlapping; gathered, not overlapping.
        for gather_output, overlap in ((False, True), (True, False)):
            out_cols = 2 * D if gather_output else 2 * D // world
            add(f"column sp={sp} gather={gather_output} overlap={overlap}", _compare(
                functools.partial(ColumnParallelLinear.from_linear, _linear(2, D, 2 * D),
                                  gather_output=gather_output, sequence_parallel=sp,
                                  overlap_grad_reduce=overlap),
                [x_in], _randn(3, B, T, out_cols)))
        # Row layer: the input sharded or whole.
        for input_is_parallel in (True, False):
            width = 2 * D // world if input_is_parallel else 2 * D
            add(f"row sp={sp} input_is_parallel={input_is_parallel}", _compare(
                functools.partial(RowParallelLinear.from_linear, _linear(4, 2 * D, D),
                                  input_is_parallel=input_is_parallel, sequence_parallel=sp),
                [_randn(5, B, T, width)], _randn(6, B, local_t if sp else T, D)))
        # A block sharded by a plan: one graph forward and backward.
        add(f"block sp={sp}", _compare(
            functools.partial(_sharded_block, sp), [x_in], _randn(7, B, local_t if sp else T, D)))
        # The embedding (its id check an assertion in the graph).
        ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(8))
        table = nn.Embedding(VOCAB, D).to(DTYPE)
        add(f"embedding sp={sp}", _compare(
            functools.partial(VocabParallelEmbedding.from_embedding, table,
                              sequence_parallel=sp),
            [ids], _randn(9, B, local_t if sp else T, D)))

    # The mappings on their own.
    x = _randn(10, B, T, D)
    local_x = _randn(11, B, T // world, D)
    mappings = {
        "copy_to_region": (lambda: copy_to_region, x, (B, T, D)),
        "reduce_from_region": (lambda: reduce_from_region, x, (B, T, D)),
        "split_to_region": (lambda: split_to_region, x, (B, T, D // world)),
        "gather_from_region": (lambda: gather_from_region, _randn(12, B, T, D // world),
                               (B, T, D)),
        "split_to_sequence": (lambda: split_to_sequence, x, (B, T // world, D)),
        "gather_from_sequence": (lambda: gather_from_sequence, local_x, (B, T, D)),
        "reduce_scatter_to_sequence": (lambda: reduce_scatter_to_sequence, x,
                                       (B, T // world, D)),
    }
    for name, (make, inp, out_shape) in mappings.items():
        add(name, _compare(make, [inp], _randn(13, *out_shape)))

    # The loss.
    logits = _randn(14, B, T, 2 * world)
    targets = torch.randint(0, 2 * world * world, (B, T),
                            generator=torch.Generator().manual_seed(15))
    targets[0, 0] = -100
    add("cross-entropy", _compare(lambda: vocab_parallel_cross_entropy, [logits, targets],
                                  torch.ones((), dtype=DTYPE)))
    # Ids outside the vocabulary are still refused, by the graph's assertion.
    torch._dynamo.reset()
    embed = torch.compile(VocabParallelEmbedding.from_embedding(table), backend=BACKEND,
                          fullgraph=True)
    try:
        embed(torch.full((B, T), VOCAB))
        notes["bad id"] = "accepted"
    except RuntimeError as exc:
        notes["bad id"] = str(exc)

    # The fallbacks, traced: all-reduce then slice, and an all-reduce of zeros around
    # this rank's part.
    with fallback_collectives():
        add("fallback column sp", _compare(
            lambda: ColumnParallelLinear.from_linear(_linear(2, D, 2 * D),
                                                     sequence_parallel=True),
            [local_x], _randn(3, B, T, 2 * D // world)))
        add("fallback row sp", _compare(
            lambda: RowParallelLinear.from_linear(_linear(4, 2 * D, D), sequence_parallel=True),
            [_randn(5, B, T, 2 * D // world)], _randn(6, B, T // world, D)))
        add("fallback gather_from_region", _compare(
            lambda: gather_from_region, [_randn(12, B, T, D // world)], _randn(13, B, T, D)))

    # Under bf16 autocast (the column layer casts as autocast runs F.linear).
    def autocast_column():
        layer = ColumnParallelLinear.from_linear(_linear(16, D, 2 * D).float(),
                                                 sequence_parallel=True)

        def run(inp):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return layer(inp)
        run.named_parameters = layer.named_parameters
        return layer, run

    def autocast_case(compiled: bool):
        layer, run = autocast_column()
        if compiled:
            torch._dynamo.reset()
            run = torch.compile(run, backend=BACKEND, fullgraph=True)
        inp = local_x.float().clone().requires_grad_()
        y = run(inp)
        (y.float() * _randn(17, B, T, 2 * D // world, dtype=torch.float32)).sum().backward()
        return y, inp.grad, layer.weight.grad

    want, got = autocast_case(False), autocast_case(True)
    notes["autocast dtypes"] = tuple(str(t.dtype) for t in got)
    for k, g, w in zip(("y", "dx", "dW"), got, want):
        errors[f"autocast column sp:{k}"] = rel_err(g.double(), w.double())

    # Compiled code records nothing. The forward and backward graphs (AOTAutograd's) hold
    # the functional collectives; in the column layer's backward the input gradient's
    # reduction starts before the weight gradient's product and is waited for after it
    # (with the overlap off, before it).
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs: dict[str, list[str]] = {}

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = [str(n.target) for n in gm.graph.nodes
                            if n.op == "call_function"]
            return make_boxed_func(gm.forward)
        return compiler

    for overlap in (True, False):
        layer = ColumnParallelLinear.from_linear(_linear(2, D, 2 * D), sequence_parallel=True,
                                                 overlap_grad_reduce=overlap)
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True, backend=aot_autograd(
            fw_compiler=keep(f"forward overlap={overlap}"),
            bw_compiler=keep(f"backward overlap={overlap}")))
        with count_communication() as counter:
            compiled(local_x.clone().requires_grad_()).sum().backward()
        notes[f"records under compile overlap={overlap}"] = len(counter.records)
    notes["graphs"] = graphs
    return {"errors": errors, "notes": notes}


def _collectives(ops: list[str]) -> list[str]:
    """The collective and wait ops of a graph, in order, by short name."""
    return [op.split(".")[1] for op in ops if op.startswith("_c10d_functional.")]


def test_compiled_layers_match_eager(world_size):
    results = run_ranks(compile_rank, world_size, timeout=300)
    for rank, got in enumerate(results):
        bad = {k: v for k, v in got["errors"].items()
               if not v < (2e-2 if k.startswith("autocast") else tp_models.TOL)}
        assert not bad, f"rank {rank}: {bad}"
        notes = got["notes"]
        assert notes["autocast dtypes"] == ("torch.bfloat16", "torch.float32",
                                            "torch.float32"), notes
        assert notes["records under compile overlap=True"] == 0
        assert notes["records under compile overlap=False"] == 0
        assert "token ids outside [0, 36)" in notes["bad id"], notes["bad id"]
        graphs = notes["graphs"]
        if world_size == 1:  # a group of one communicates nothing
            assert all(_collectives(ops) == [] for ops in graphs.values()), graphs
            continue
        for overlap in (True, False):
            forward, backward = (graphs[f"{kind} overlap={overlap}"]
                                 for kind in ("forward", "backward"))
            # Sequence parallel: the input gathered forward; backward the gradient
            # reduce-scattered, waited for after the weight gradient's product (mm) when
            # they overlap, before it when they do not.
            assert _collectives(forward) == ["all_gather_into_tensor", "wait_tensor"], forward
            assert _collectives(backward) == ["reduce_scatter_tensor", "wait_tensor"], backward
            started = backward.index("_c10d_functional.reduce_scatter_tensor.default")
            waited = backward.index("_c10d_functional.wait_tensor.default")
            between = [op for op in backward[started:waited] if op.startswith("aten.mm")]
            assert len(between) == (1 if overlap else 0), (overlap, backward)
