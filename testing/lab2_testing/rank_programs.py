"""The functions minddp's Gloo tests run on every rank.

They live apart from the test files so that each spawned rank imports only
torch, minddp and the test kit: importing pytest and hypothesis again in every
rank costs seconds per ``run_ranks`` call on a loaded 2-core machine.
"""

from __future__ import annotations

import torch

from lab2_testing import ddp_testkit as kit
from minddp import (
    DDPBucketed,
    DDPIndividualParameters,
    ModelMismatchError,
    broadcast_module,
    check_model_consistency,
)

# ---- parity: every variant x model ----
PARITY_STEPS = 3
PARITY_BATCH = 12  # divisible by every world size 1..4
PARITY_SEED = 1234
PARITY_KINDS = ("mlp", "tied", "transformer")


def parity_rank(rank: int, world_size: int, split: list[int]) -> dict:
    torch.set_num_threads(1)
    return {
        (kind, variant): kit.train_distributed(
            kind, variant, rank, world_size, split, PARITY_STEPS, PARITY_SEED
        )
        for kind in PARITY_KINDS
        for variant in kit.VARIANTS
    }



def zeroed_gradients_rank(rank: int, world_size: int, split: list[int]) -> dict:
    """The overlapping wrappers with ``zero_grad(set_to_none=False)`` between steps."""
    torch.set_num_threads(1)
    return {
        (kind, variant): kit.train_distributed(
            kind, variant, rank, world_size, split, PARITY_STEPS, PARITY_SEED,
            set_to_none=False,
        )
        for kind in PARITY_KINDS
        for variant in ("individual", "bucketed_few")
    }


# ---- rank-dependent branches and no_sync ----
BRANCH_STEPS = 3
BRANCH_BATCH = 12
BRANCH_SEED = 99
OVERLAPPING = ("individual", "bucketed_tiny", "bucketed_few", "bucketed_one")


def skips_backward(rank: int, world_size: int, step: int) -> bool:
    """The last rank sits out step 1 entirely (no forward, no backward)."""
    return world_size > 1 and rank == world_size - 1 and step == 1


def halves(start: int, end: int) -> list[tuple[int, int]]:
    middle = start + (end - start) // 2
    return [(start, middle), (middle, end)]


def branches_rank(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    batches = kit.make_batches("branchy", BRANCH_SEED, BRANCH_STEPS, BRANCH_BATCH)
    per = BRANCH_BATCH // world_size
    start, end = rank * per, (rank + 1) * per
    even = rank % 2 == 0
    scale = world_size / BRANCH_BATCH
    out: dict = {}
    for variant in kit.VARIANTS:  # branches, and a rank that skips backward
        model = kit.build_model("branchy", BRANCH_SEED + 1000 * rank)
        runner, sync = kit.wrap(variant, model)
        optimizer = kit.make_optimizer(model)
        for step, (x, y) in enumerate(batches):
            optimizer.zero_grad()
            if not skips_backward(rank, world_size, step):
                out_ = runner(x[start:end], even)
                (kit.summed_loss("branchy", out_, y[start:end]) * scale).backward()
            sync()
            optimizer.step()
        out[("branches", variant)] = kit.snapshot(model)
    for variant in OVERLAPPING:  # no_sync: first half-slice local, second synced
        model = kit.build_model("branchy", BRANCH_SEED + 1000 * rank)
        ddp, _ = kit.wrap(variant, model)
        optimizer = kit.make_optimizer(model)
        for x, y in batches:
            optimizer.zero_grad()
            (a, b), (c, d) = halves(start, end)
            with ddp.no_sync():
                (kit.summed_loss("branchy", ddp(x[a:b], even), y[a:b]) * scale).backward()
                try:  # refused inside no_sync, leaving the accumulation as it was
                    ddp.finish_gradient_synchronization()
                except RuntimeError:
                    pass
                else:
                    raise AssertionError("finish inside no_sync did not raise")
                assert not ddp._handles, "no_sync launched a collective"
            (kit.summed_loss("branchy", ddp(x[c:d], not even), y[c:d]) * scale).backward()
            ddp.finish_gradient_synchronization()
            optimizer.step()
        out[("no_sync", variant)] = kit.snapshot(model)
    return out



# ---- construction checks, views, misuse ----
GUARD_SEED = 7

# How the last rank's model differs, and what the error must name.
MUTATIONS = {
    "shape": ("layers.0.weight", "shape="),
    "dtype": ("frozen_scale", "dtype="),  # own parameters come before submodules
    "frozen": ("layers.1.weight", "requires_grad="),
    "extra": ("layers.1.extra", "vs param 'layers.1.extra'"),
}


def _mutated_mlp(mutation: str, rank: int, world_size: int) -> torch.nn.Module:
    last = rank == world_size - 1
    widths = (6, 9, 3) if last and mutation == "shape" else (6, 8, 3)
    model = kit.build_model("mlp", GUARD_SEED, widths=widths)
    if last and mutation == "dtype":
        model.float()
    if last and mutation == "frozen":
        model.layers[1].requires_grad_(False)
    if last and mutation == "extra":
        model.layers[1].extra = torch.nn.Parameter(torch.zeros(2, dtype=kit.DTYPE))
    return model


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _bucketed_step(ddp: DDPBucketed, x: torch.Tensor, y: torch.Tensor) -> None:
    kit.summed_loss("mlp", ddp(x), y).backward()
    ddp.finish_gradient_synchronization()


def guards_rank(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    out: dict = {"mismatch": {}, "errors": {}}
    # 1. A model that differs on one rank: every rank raises, none hangs.
    if world_size > 1:
        for mutation in MUTATIONS:
            for wrapper in (DDPBucketed, DDPIndividualParameters, None):
                model = _mutated_mlp(mutation, rank, world_size)
                try:
                    if wrapper is None:
                        check_model_consistency(model)
                    else:
                        wrapper(model)
                    out["mismatch"][(mutation, str(wrapper))] = None
                except ModelMismatchError as error:
                    out["mismatch"][(mutation, str(wrapper))] = str(error)
    # 2. broadcast_module from the last rank: parameters and buffers.
    model = kit.build_model("mlp", GUARD_SEED + rank)
    broadcast_module(model, src=world_size - 1)
    out["broadcast"] = kit.snapshot(model)
    # 3. Gradients are views into bucket buffers, also after zero_grad(set_to_none=True).
    x, y = kit.make_batches("mlp", GUARD_SEED, 1, 4)[0]
    model = kit.build_model("mlp", GUARD_SEED)
    ddp = DDPBucketed(model, kit.few_buckets_mb(model))
    out["bucket_names"] = ddp.bucket_parameter_names
    views_ok = []
    for _ in range(3):
        _bucketed_step(ddp, x, y)
        storages = {_storage(b.buffer) for b in ddp._buckets}
        views_ok.append(
            all(_storage(p.grad) in storages for n, p in model.named_parameters()
                if p.requires_grad and n != "unused")
            and model.unused.grad is None
        )
        model.zero_grad(set_to_none=True)
    out["views_ok"] = views_ok
    out["stats"] = ddp.last_sync_stats
    out["bucket_counts"] = {
        variant: len(kit.wrap(variant, kit.build_model("mlp", GUARD_SEED))[0]._buckets)
        for variant in ("bucketed_tiny", "bucketed_few", "bucketed_one")
    }
    # 4. Misuse: forward before finishing, and a second backward after launching.
    # (tiny buckets, so that some bucket surely went out during the first backward)
    for wrapper in (lambda m: DDPBucketed(m, 1e-9), DDPIndividualParameters):
        ddp = wrapper(kit.build_model("mlp", GUARD_SEED))
        loss = kit.summed_loss("mlp", ddp(x), y)
        loss.backward(retain_graph=True)
        ddp.finish_gradient_synchronization()  # first step: launch order learned
        loss.backward(retain_graph=True)
        messages = []
        try:
            ddp(x)
        except RuntimeError as error:
            messages.append(str(error))
        try:
            loss.backward()
        except RuntimeError as error:
            messages.append(str(error))
        ddp.finish_gradient_synchronization()  # wait for what did go out
        out["errors"][type(ddp).__name__] = messages
    return out


def gradient_order_rank(rank: int, world_size: int) -> dict:
    """A wrapper given another's learned order: same buckets from its first step, the
    same gradients bit for bit; bad orders and a mid-step call refused."""
    torch.set_num_threads(1)
    batches = kit.make_batches("transformer", GUARD_SEED, 3, 4 * world_size)
    out: dict = {}
    for name, make in (
        ("bucketed", lambda m: DDPBucketed(m, kit.few_buckets_mb(m) / 2, bucket_rule="reach")),
        ("individual", DDPIndividualParameters),
    ):
        models = [kit.build_model("transformer", GUARD_SEED) for _ in range(3)]
        learner, told, _ = (make(m) for m in models)
        before = learner.gradient_order
        x, y = batches[0]
        kit.summed_loss("transformer", learner(x[rank::world_size]), y[rank::world_size]).backward()
        learner.finish_gradient_synchronization()
        order = learner.gradient_order
        told.set_gradient_order(order)
        same = [getattr(learner, "bucket_parameter_names", None)
                == getattr(told, "bucket_parameter_names", None), told.gradient_order == order]
        for x, y in batches[1:]:
            grads = []
            for ddp, model in ((learner, models[0]), (told, models[1])):
                model.zero_grad(set_to_none=True)
                kit.summed_loss("transformer", ddp(x[rank::world_size]),
                                y[rank::world_size]).backward()
                ddp.finish_gradient_synchronization()
                grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
            same.append(all(torch.equal(a, b) for a, b in zip(*grads)))
        errors = []
        try:
            told.set_gradient_order([0] * len(order))
        except ValueError as error:
            errors.append(str(error))
        kit.summed_loss("transformer", told(x[rank::world_size]), y[rank::world_size]).backward()
        try:
            told.set_gradient_order(order)
        except RuntimeError as error:
            errors.append(str(error))
        told.finish_gradient_synchronization()
        out[name] = {"before": before, "order": order, "same": same, "errors": errors}
    return out


def finish_in_no_sync_rank(rank: int, world_size: int) -> dict:
    """Each overlapping wrapper asked to finish inside ``no_sync``: the error it raises,
    then the gradients after the step finished properly (one no_sync backward, one
    synchronized)."""
    torch.set_num_threads(1)
    (x, y), = kit.make_batches("mlp", GUARD_SEED, 1, 2 * world_size)
    out: dict = {}
    for name, make in (("DDPBucketed", lambda m: DDPBucketed(m, 1e-9)),
                       ("DDPIndividualParameters", DDPIndividualParameters)):
        model = kit.build_model("mlp", GUARD_SEED + rank)  # broadcast from rank 0
        ddp = make(model)
        message = None
        with ddp.no_sync():
            kit.summed_loss("mlp", ddp(x[2 * rank : 2 * rank + 1]), y[2 * rank : 2 * rank + 1]
                            ).backward()
            try:
                ddp.finish_gradient_synchronization()
            except RuntimeError as error:
                message = str(error)
        kit.summed_loss("mlp", ddp(x[2 * rank + 1 : 2 * rank + 2]),
                        y[2 * rank + 1 : 2 * rank + 2]).backward()
        ddp.finish_gradient_synchronization()
        out[name] = {"message": message,
                     "grads": {n: None if q.grad is None else q.grad.clone()
                               for n, q in model.named_parameters()}}
    return out


# ---- where gradients live during backward ----
def gradient_home_rank(rank: int, world_size: int) -> dict:
    """Which ``.grad`` tensors are bucket views at three points of a step.

    Records the names of trainable parameters whose gradient is not a view into a
    bucket: after a no_sync backward, and, in the synchronized backward that follows,
    when a bucket's last hook has run (probed from a hook registered after the
    wrapper's, on the bucket's last member) and after the finish call.
    """
    torch.set_num_threads(1)
    model = kit.build_model("mlp", GUARD_SEED)
    ddp = DDPBucketed(model, kit.few_buckets_mb(model))
    x, y = kit.make_batches("mlp", GUARD_SEED + rank, 1, 4)[0]
    names = {id(p): n for n, p in model.named_parameters()}

    def outside(params) -> list[str]:
        storages = {_storage(b.buffer) for b in ddp._buckets}
        return sorted(names[id(p)] for p in params
                      if p.grad is not None and _storage(p.grad) not in storages)

    out: dict = {"full_buckets": []}
    kit.summed_loss("mlp", ddp(x), y).backward()  # the first step learns the order
    ddp.finish_gradient_synchronization()
    model.zero_grad(set_to_none=True)
    with ddp.no_sync():
        kit.summed_loss("mlp", ddp(x), y).backward()
    out["after_no_sync"] = outside(model.parameters())
    model.zero_grad(set_to_none=True)  # fresh gradients again for the synced backward
    for bucket in ddp._buckets:
        members = bucket.params
        if any(p is model.unused for p in members):
            continue  # never fills during backward

        def probe(_p, members=members):
            out["full_buckets"].append(outside(members))

        members[-1].register_post_accumulate_grad_hook(probe)
    kit.summed_loss("mlp", ddp(x), y).backward()
    ddp.finish_gradient_synchronization()
    out["after_finish"] = outside(model.parameters())
    return out


# ---- property: drawn configurations ----
PROPERTY_STEPS = 2
PROPERTY_VARIANTS = ("naive", "flat", "individual", "bucketed")


def property_rank(rank: int, world_size: int, config: dict) -> dict:
    torch.set_num_threads(1)
    return {
        variant: kit.train_distributed(
            "mlp", variant, rank, world_size, config["split"], PROPERTY_STEPS, config["seed"],
            config["model_kwargs"], config["bucket_size_mb"],
        )
        for variant in PROPERTY_VARIANTS
    }


# ---- a peer that leaves ----
def dead_peer_rank(rank: int, world_size: int) -> dict:
    """The last rank leaves after construction; the others must get an error, not hang."""
    import time

    torch.set_num_threads(1)
    model = kit.build_model("mlp", GUARD_SEED)
    ddp = DDPBucketed(model, 1e-9)
    if rank == world_size - 1:
        return {"left": True}
    x, y = kit.make_batches("mlp", GUARD_SEED, 1, 4)[0]
    kit.summed_loss("mlp", ddp(x), y).backward()
    start = time.perf_counter()
    try:
        ddp.finish_gradient_synchronization()
    except RuntimeError as error:  # Gloo: peer closed, or the group's timeout
        return {"error": str(error)[:200], "seconds": time.perf_counter() - start}
    return {"error": None, "seconds": time.perf_counter() - start}


# ---- the averaging collective ----
def averaging_rank(rank: int, world_size: int, seed: int) -> dict:
    from minddp import Averager

    averager = Averager()
    out = {"native": averager.native_average, "world_size": averager.world_size}
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        g = torch.Generator().manual_seed(seed + rank)
        t = torch.randn(37, generator=g, dtype=torch.float64).to(dtype)
        handle = averager.start(t)
        handle.wait()
        out[str(dtype)] = t.double()
        out["collective"] = isinstance(handle, torch.distributed.Work)
    return out


# ---- DDPBucketed(reduce_dtype=...) ----
REDUCE_KINDS = ("mlp", "tied", "transformer")


def one_step_gradients(kind: str, model: torch.nn.Module, runner, sync, rank: int,
                       world_size: int, split: list[int], seed: int) -> dict:
    """Gradients (or None) after one backward on this rank's slice and ``sync()``."""
    x, y = kit.make_batches(kind, seed, 1, sum(split))[0]
    start, end = kit.split_bounds(split)[rank]
    loss = kit.summed_loss(kind, runner(x[start:end]), y[start:end]) * (world_size / sum(split))
    loss.backward()
    sync()
    return {n: (None if p.grad is None else p.grad.detach().clone())
            for n, p in model.named_parameters()}


def reduce_dtype_rank(rank: int, world_size: int, split: list[int], seed: int,
                      dtype_name: str) -> dict:
    torch.set_num_threads(1)
    out = {}
    for kind in REDUCE_KINDS:
        model = kit.build_model(kind, seed + 1000 * rank)
        ddp = DDPBucketed(model, kit.few_buckets_mb(model),
                          reduce_dtype=getattr(torch, dtype_name))
        out[kind] = one_step_gradients(kind, model, ddp, ddp.finish_gradient_synchronization,
                                       rank, world_size, split, seed)
    return out
