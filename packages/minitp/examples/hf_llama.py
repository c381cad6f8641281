"""Shard a tiny Hugging Face Llama over two Gloo ranks with minitp, and check it against the
model whole.

    python packages/minitp/examples/hf_llama.py        # needs: pip install transformers

Every rank builds the same ``LlamaForCausalLM`` from a ``LlamaConfig`` (random weights,
nothing downloaded), keeps an untouched copy, and shards the other in place with
``parallelize(model, llama_plan(config))``. Each rank then holds half of every projection,
half of the embedding rows and half of the output layer, and gets its half of the
vocabulary of the logits. The check, on every rank: those logits against the same slice
of the whole model's; the loss from ``vocab_parallel_cross_entropy`` against
``F.cross_entropy`` on the whole logits; after backward, the gradients of a few sharded
and whole parameters against the whole model's (float32, to 1e-5 relative).
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minitp import llama_plan, parallelize, vocab_parallel_cross_entropy

TOL = 1e-5


def tiny_llama(seed: int = 0):
    """A two-layer Llama, 4 query and 2 key/value heads of 8, vocabulary 64."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, max_position_embeddings=64, use_cache=False)
    torch.manual_seed(seed)
    return config, LlamaForCausalLM(config).float().eval()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-6)).item()


def check(rank: int, world_size: int) -> dict[str, float]:
    """Run on every rank of an initialised group; returns relative errors by name."""
    config, model = tiny_llama()
    whole = copy.deepcopy(model)
    parallelize(model, llama_plan(config))

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=g)
    targets = torch.randint(0, config.vocab_size, (2, 16), generator=g)
    local_logits = model(input_ids=ids).logits  # [2, 16, 64 / world_size]
    loss = vocab_parallel_cross_entropy(local_logits, targets)
    loss.backward()
    full_logits = whole(input_ids=ids).logits
    full_loss = F.cross_entropy(full_logits.flatten(0, 1), targets.flatten())
    full_loss.backward()

    part = config.vocab_size // world_size
    rows = slice(rank * part, (rank + 1) * part)
    layer, full_layer = model.model.layers[0], whole.model.layers[0]
    heads = slice(rank * 4 * 8 // world_size, (rank + 1) * 4 * 8 // world_size)
    ff = slice(rank * 64 // world_size, (rank + 1) * 64 // world_size)
    return {
        "logits": _rel(local_logits, full_logits[..., rows]),
        "loss": _rel(loss, full_loss),
        "embed grad": _rel(model.model.embed_tokens.weight.grad,
                           whole.model.embed_tokens.weight.grad[rows]),
        "lm_head grad": _rel(model.lm_head.weight.grad, whole.lm_head.weight.grad[rows]),
        "q_proj grad": _rel(layer.self_attn.q_proj.weight.grad,
                            full_layer.self_attn.q_proj.weight.grad[heads]),
        "o_proj grad": _rel(layer.self_attn.o_proj.weight.grad,
                            full_layer.self_attn.o_proj.weight.grad[:, heads]),
        "down_proj grad": _rel(layer.mlp.down_proj.weight.grad,
                               full_layer.mlp.down_proj.weight.grad[:, ff]),
        "input_layernorm grad": _rel(layer.input_layernorm.weight.grad,
                                     full_layer.input_layernorm.weight.grad),
    }


def _worker(rank: int, world_size: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    try:
        errors = check(rank, world_size)
        if rank == 0:
            print("| what | relative error (rank 0) |\n|---|---|")
            for name, err in errors.items():
                print(f"| {name} | {err:.1e} |")
        bad = {k: v for k, v in errors.items() if not v < TOL}
        if bad:
            raise AssertionError(f"rank {rank}: above {TOL}: {bad}")
    finally:
        dist.destroy_process_group()


def main() -> int:
    world_size = 2
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_worker, args=(world_size, os.path.join(tmp, "rdzv")),
                                    nprocs=world_size)
    print(f"tensor-parallel Llama on {world_size} Gloo ranks matches the whole model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
