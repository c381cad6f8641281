"""tritonnorm inside whole models on one GPU: training-step time against the unswapped norm.

Two models: the trainer's ``TransformerLM`` (``--model trainer``: nn.RMSNorm against
tritonnorm's fused add + norm) and a Hugging Face Llama of about 1B parameters built from
its config (``--model hf``: ``LlamaRMSNorm`` against ``replace_rms_norms``). Each cell
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

    python packages/tritonnorm/benchmarks/in_model.py --model trainer --presets small,medium \\
        --batches 8,32 --modes eager,default,reduce-overhead --out trainer.jsonl
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

from lab2bench.timing import paired_windows
from tritonnorm import replace_rms_norms
from tritonnorm._machinery import SWITCHES
from tritonnorm.ops import OPTIONS

HF_LLAMA = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
                num_key_value_heads=16, intermediate_size=5632, vocab_size=32000)


def trainer_model(preset: str, norm: str, batch: int):
    from lab2_trainer.config import model_config
    from lab2_trainer.models.transformer import TransformerLM

    config = model_config(preset, context_length=512, vocab_size=10000,
                          norm="torch" if norm == "torch" else "tritonnorm")
    model = TransformerLM(config, seed=0, device=torch.device("cuda")).train()
    tokens = torch.randint(0, config.vocab_size, (batch, 513), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(0))
    return model, (tokens[:, :-1], tokens[:, 1:])


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
    the calling thread as the trainer runs it, with ``options`` set (``switched``)."""
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("trainer", "hf"), default="trainer")
    p.add_argument("--presets", default="small,medium", help="trainer presets")
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
    args = p.parse_args()
    torch._dynamo.config.cache_size_limit = 64
    presets = args.presets.split(",") if args.model == "trainer" else ["1B"]
    batches = [int(b) for b in args.batches.split(",")] if args.model == "trainer" else [8]
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
                        model, data = (trainer_model(preset, norm, batch)
                                       if args.model == "trainer" else hf_model(norm, batch))
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
