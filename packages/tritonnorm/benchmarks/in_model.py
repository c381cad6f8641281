"""tritonnorm inside whole models on one GPU: training-step time against the unswapped norm.

Two models: a Llama-like decoder-only LM defined in this script (``--model lm``: pre-norm
blocks, rotary positions, SwiGLU, a tied head, at the sizes of ``PRESETS``; nn.RMSNorm
against tritonnorm's fused add + norm; ``--model trainer`` is the same, the choice's name
before tritonnorm 0.10.0) and a Hugging Face Llama of about 1B parameters built from its
config (``--model hf``: ``LlamaRMSNorm`` against ``replace_rms_norms``). Each cell
(preset, batch, mode) builds every variant in one process and times them in short windows
of back-to-back training steps (bf16 autocast, fused AdamW, backward on the calling
thread), in a balanced order (see ``paired_windows``); the ratio is the median over rounds
of (the unswapped model's window / this variant's window), so > 1 means faster.
``--all-paths`` adds tritonnorm with each path forced: ``tritonnorm-kernels`` and
``tritonnorm-torch`` (``OPTIONS.eager_dispatch``) eager, ``tritonnorm-kernels`` and
``tritonnorm-inductor`` (``OPTIONS.compiled_dispatch``) compiled. ``--machinery`` adds,
eager, the kernels forced with each piece of the launch machinery switched off in turn
(``kernels-no-plans``, ``kernels-jit``, ``kernels-no-fold``). ``--liger`` adds, to the HF
model's eager cells, Liger-Kernel's RMSNorm patch alone (``liger``; left out with a note
where ``liger_kernel`` does not import). ``--variants`` names the variants instead (fewer
models in memory at once). ``--control`` adds a second unswapped model, ``torch-again``,
whose ratio shows the measurement's own spread. The windows are
``lab2bench.timing.paired_windows``'s. One JSON line per variant goes to ``--out``.

    python packages/tritonnorm/benchmarks/in_model.py --model lm --presets small,medium \\
        --batches 8,32 --modes eager,default,reduce-overhead --out lm.jsonl
    python packages/tritonnorm/benchmarks/in_model.py --model hf --modes eager,default \\
        --all-paths --liger --out hf.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys

import torch
import torch.nn.functional as F
from torch import nn

from lab2bench.timing import paired_windows
from tritonnorm import replace_rms_norms
from tritonnorm._machinery import SWITCHES
from tritonnorm.nn import FusedAddRMSNorm
from tritonnorm.ops import OPTIONS

HF_LLAMA = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
                num_key_value_heads=16, intermediate_size=5632, vocab_size=32000)


# ------------------------------------------------------------------ the Llama-like LM
#: Sizes of the LM (``--presets``): small and medium as GPT-2's (768 and 1,024 wide, 12
#: and 24 layers), 4x-wide SwiGLU; tiny for a quick check on the CPU.
PRESETS = {
    "tiny": dict(d_model=64, d_ff=256, n_layers=2, n_heads=4),
    "small": dict(d_model=768, d_ff=3072, n_layers=12, n_heads=12),
    "medium": dict(d_model=1024, d_ff=4096, n_layers=24, n_heads=16),
}
LM_CONTEXT = 512
LM_VOCAB = 10000
EPS = 1e-5


def add_and_norm(norm: nn.Module, branch: torch.Tensor | None, residual: torch.Tensor):
    """``(norm(residual + branch), residual + branch)``: tritonnorm's ``FusedAddRMSNorm``
    does both in one kernel each way, ``nn.RMSNorm`` after a separate add. The sum keeps the
    residual stream's dtype (float32 under autocast), as the plain add would."""
    if branch is None:
        return norm(residual), residual
    if isinstance(norm, FusedAddRMSNorm):
        return norm(residual, branch)
    total = residual + branch
    return norm(total), total


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions: each pair (first half, second half of a head) turned by its angle."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


class Block(nn.Module):
    """Pre-norm attention then SwiGLU; the branch output is added by the next norm."""

    def __init__(self, d_model: int, d_ff: int, n_heads: int, norm: str) -> None:
        super().__init__()
        make = (lambda: FusedAddRMSNorm(d_model, eps=EPS)) if norm == "tritonnorm" else (
            lambda: nn.RMSNorm(d_model, eps=EPS))
        self.n_heads = n_heads
        self.attn_norm, self.mlp_norm = make(), make()
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.gate_up = nn.Linear(d_model, 2 * d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, residual, pending, cos, sin):
        x, residual = add_and_norm(self.attn_norm, pending, residual)
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v,
                                           is_causal=True)
        x, residual = add_and_norm(self.mlp_norm, self.proj(y.transpose(1, 2).reshape(b, t, d)),
                                   residual)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return residual, self.down(F.silu(gate) * up)


class LlamaLikeLM(nn.Module):
    """Token embedding, ``n_layers`` blocks, a final norm and a head tied to the embedding;
    ``norm``: "torch" (``nn.RMSNorm``) or "tritonnorm" (``FusedAddRMSNorm``)."""

    def __init__(self, d_model: int, d_ff: int, n_layers: int, n_heads: int, norm: str,
                 vocab_size: int = LM_VOCAB, context: int = LM_CONTEXT) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, d_ff, n_heads, norm)
                                    for _ in range(n_layers))
        self.norm = FusedAddRMSNorm(d_model, eps=EPS) if norm == "tritonnorm" else (
            nn.RMSNorm(d_model, eps=EPS))
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.embed.weight
        half = d_model // n_heads // 2
        angles = torch.outer(torch.arange(context, dtype=torch.float32),
                             10000.0 ** (-torch.arange(half, dtype=torch.float32) / half))
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        residual, pending = self.embed(idx), None
        for block in self.blocks:
            residual, pending = block(residual, pending, cos, sin)
        return self.head(add_and_norm(self.norm, pending, residual)[0])


def lm_model(preset: str, norm: str, batch: int, device: str = "cuda"):
    """The LM at ``preset``'s size, seeded, and a batch of ``batch`` random sequences of
    :data:`LM_CONTEXT` tokens (inputs, targets)."""
    torch.manual_seed(0)
    model = LlamaLikeLM(**PRESETS[preset], norm="torch" if norm == "torch" else "tritonnorm")
    model = model.to(device).train()
    tokens = torch.randint(0, LM_VOCAB, (batch, LM_CONTEXT + 1), device=device,
                           generator=torch.Generator(device).manual_seed(0))
    return model, (tokens[:, :-1], tokens[:, 1:])


# ------------------------------------------------------------------ the Hugging Face Llama
def hf_model(norm: str, batch: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**HF_LLAMA)).cuda().train()
    if norm == "liger":  # its patch also replaces transformers' LlamaRMSNorm: restored
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        original = modeling_llama.LlamaRMSNorm
        try:
            apply_liger_kernel_to_llama(rope=False, cross_entropy=False, swiglu=False,
                                        fused_linear_cross_entropy=False, model=model)
        finally:
            modeling_llama.LlamaRMSNorm = original
    elif norm != "torch":
        replace_rms_norms(model)
    tokens = torch.randint(0, HF_LLAMA["vocab_size"], (batch, 1025), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(0))
    return model, (tokens[:, :-1], tokens[:, 1:])


def switched(options: dict) -> contextlib.ExitStack:
    """``options`` set for a ``with`` block: tritonnorm's ``OPTIONS`` and, for the launch
    machinery's pieces (``launch_plans``, ``direct_launch``, ``fold_dw_sum``), its
    ``SWITCHES``."""
    pieces = {f.name for f in dataclasses.fields(SWITCHES)}
    stack = contextlib.ExitStack()
    stack.enter_context(OPTIONS.override(**{k: v for k, v in options.items()
                                            if k not in pieces}))
    stack.enter_context(SWITCHES.override(**{k: v for k, v in options.items() if k in pieces}))
    return stack


def make_step(model, batch, mode: str, options: dict):
    """One training step of ``model`` (compiled unless ``mode`` is eager), its backward on
    the calling thread, with ``options`` set (``switched``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    fwd = model if mode == "eager" else torch.compile(
        model, mode=None if mode == "default" else mode)
    x, y = batch

    def step() -> None:
        with switched(options), torch.autograd.set_multithreading_enabled(False):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = fwd(x)
                logits = out if isinstance(out, torch.Tensor) else out.logits
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


#: Variants beside the unswapped model: name -> tritonnorm options.
EAGER = {"tritonnorm": {}, "tritonnorm-kernels": {"eager_dispatch": "kernels"},
         "tritonnorm-torch": {"eager_dispatch": "torch"}}
COMPILED = {"tritonnorm": {}, "tritonnorm-kernels": {"compiled_dispatch": "kernels"},
            "tritonnorm-inductor": {"compiled_dispatch": "inductor"}}
#: ``--machinery``: the kernels forced, each piece of the eager launch machinery taken
#: away in turn (the recorded launch plans; the direct launcher, and the plans with it;
#: the weight-gradient sum folded into the backward kernel), against "tritonnorm-kernels".
MACHINERY = {
    "kernels-no-plans": {"eager_dispatch": "kernels", "launch_plans": False},
    "kernels-jit": {"eager_dispatch": "kernels", "direct_launch": False},
    "kernels-no-fold": {"eager_dispatch": "kernels", "fold_dw_sum": False},
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("lm", "trainer", "hf"), default="lm",
                   help="lm: the Llama-like LM defined here ('trainer': the same, its old "
                        "name); hf: a Hugging Face Llama ~1B")
    p.add_argument("--presets", default="small,medium",
                   help="sizes of the lm: " + ", ".join(PRESETS))
    p.add_argument("--batches", default="8,32", help="sequences per step (hf: 8 x 1024)")
    p.add_argument("--modes", default="eager,default,reduce-overhead")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--all-paths", action="store_true",
                   help="also time tritonnorm with each path forced (eager: kernels, "
                        "F.rms_norm; compiled: kernels, Inductor's own)")
    p.add_argument("--machinery", action="store_true",
                   help="eager: also the kernels forced with each piece of the launch "
                        "machinery off (" + ", ".join(MACHINERY) + ")")
    p.add_argument("--liger", action="store_true",
                   help="--model hf, eager: also Liger-Kernel's RMSNorm patch alone")
    p.add_argument("--control", action="store_true",
                   help="also a second unswapped model (torch-again): its ratio is the "
                        "measurement's own spread (an A/A comparison)")
    p.add_argument("--variants", help="comma-separated variants to time beside the "
                   "unswapped model, instead of the flags' choice (fewer models in memory)")
    p.add_argument("--out", default="in_model.jsonl")
    args = p.parse_args(argv)
    own = args.model != "hf"
    presets = args.presets.split(",") if own else ["1B"]
    unknown = [name for name in presets if own and name not in PRESETS]
    if unknown:
        p.error(f"unknown preset(s) {', '.join(unknown)}; choose from {', '.join(PRESETS)}")
    torch._dynamo.config.cache_size_limit = 64
    batches = [int(b) for b in args.batches.split(",")] if own else [8]
    for preset in presets:
        for batch in batches:
            for mode in args.modes.split(","):
                paths = EAGER if mode == "eager" else COMPILED
                table = paths | MACHINERY if mode == "eager" else paths
                names = ["torch", "tritonnorm"]
                names += [n for n in list(paths)[1:] if args.all_paths]
                names += [n for n in MACHINERY if args.machinery and mode == "eager"]
                names += ["liger"] * (args.liger and args.model == "hf" and mode == "eager")
                if args.variants:
                    names = ["torch"] + [n for n in args.variants.split(",")
                                         if n in table or n == "liger"]
                if "tritonnorm-kernels" not in names and any(n in MACHINERY for n in names):
                    names.append("tritonnorm-kernels")  # what the machinery is taken from
                names += ["torch-again"] * args.control
                steps = {}
                for name in names:
                    norm = ("torch" if name == "torch-again" else name
                            if name in ("torch", "liger") else "tritonnorm")
                    try:
                        model, data = (lm_model(preset, norm, batch)
                                       if own else hf_model(norm, batch))
                    except ImportError as err:  # --liger where liger_kernel does not import
                        print(f"note: {name} left out: {err}", file=sys.stderr)
                        continue
                    steps[name] = make_step(model, data, mode, table.get(name, {}))
                result = paired_windows(steps, rounds=args.rounds, window=args.window,
                                        device="cuda")  # warm-up: compile, autotune, allocator
                with open(args.out, "a") as f:
                    for name, r in result.items():
                        rec = dict(model=args.model, preset=preset, batch=batch, mode=mode,
                                   variant=name, median_ms=r["median_ms"], ratio=r["ratio"],
                                   rounds=args.rounds, window=args.window)
                        f.write(json.dumps(rec) + "\n")
                        print(json.dumps(rec), flush=True)
                del steps
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
