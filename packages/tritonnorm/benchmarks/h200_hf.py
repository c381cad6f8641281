"""tritonnorm on one H200: the eager crossover to ``F.rms_norm``, and a Hugging Face Llama
of about 1B parameters, in one run of under 6 minutes.

    python packages/tritonnorm/benchmarks/h200_hf.py --out OUT_DIR [--quick] [--no-compile]

(a) **Crossover.** For H in {512 ... 8192} x rows in {8*512, 32*512, 50,000} x {bf16,
    float32} x variant (plain, gemma = offset 1, no weight), and for each path
    (``OPTIONS.eager_dispatch`` forced to "kernels", then "torch"): the eager time of one
    forward+backward call (``lab2bench.timing.measure``: calls issued back to back, host time
    where the call is host-bound, device time where not), and the device time of one call
    graph-timed (``graph_time``). The
    "auto" column says which path the current ``OPTIONS.torch_below`` picks; ``best`` says
    which eager time is lower. Set ``torch_below`` to the element count where ``best``
    turns from torch to kernels, per dtype.

(b) **Llama ~1B** (hidden 2048, 16 layers, 16 heads, intermediate 5632, vocab 32,000;
    bf16 autocast, batch 8 x 1024, fused AdamW): the eager training step unswapped, with
    ``tritonnorm.replace_rms_norms``, and with Liger-Kernel's RMSNorm patch alone (where
    ``liger_kernel`` imports); then compiled unswapped against compiled swapped. Variants
    are compared in pairs, in alternating windows of steps (paired windows); ``x`` is the
    median over rounds of (the pair's first time / the other's).

A wall-clock budget (``--budget-s``, 340 s) leaves out, and records as left out, any part
not started in time, keeping the time part (b) needs. Writes ``OUT_DIR/h200_hf.jsonl`` (one
line per measurement) and ``OUT_DIR/h200_hf.md`` (the tables), atomically.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import tritonnorm
from lab2bench.records import atomic_write_text, write_jsonl
from lab2bench.report import markdown_table
from lab2bench.timing import graph_time, measure
from tritonnorm.ops import OPTIONS, _prefer_torch

HIDDEN = (512, 1024, 2048, 4096, 8192)
ROWS = (8 * 512, 32 * 512, 50_000)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
VARIANTS = {  # name -> (casting_mode, offset, has weight)
    "plain": ("none", 0.0, True),
    "gemma": ("gemma", 1.0, True),
    "no-weight": ("none", 0.0, False),
}
LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                max_position_embeddings=2048, use_cache=False)


_sync = torch.cuda.synchronize


def budget(seconds: float):
    """Seconds left of a wall-clock budget: a part not started in time is left out (and
    recorded as such), so the whole run stays under its limit."""
    end = time.perf_counter() + seconds
    return lambda: end - time.perf_counter()


def _call_us(x, w, mode, offset, timer, repeats: int) -> float:
    """Median µs of one fwd+bwd call, timed by ``timer``: ``measure`` (calls queued back to
    back: host time where the call is host-bound, device time where not) or ``graph_time``."""
    xg = x.detach().requires_grad_()

    def fn():
        xg.grad = None  # as a fresh leaf's, freed by the next call
        return tritonnorm.rms_norm(xg, w, 1e-6, casting_mode=mode, offset=offset)

    return timer(fn, warmup=max(2, repeats // 3), repeats=repeats, backward=True).median * 1e6


def crossover(quick: bool, log, left, reserve: float) -> list[dict]:
    hidden = HIDDEN[:2] if quick else HIDDEN
    rows_set = ROWS[:1] if quick else ROWS
    repeats = 10 if quick else 30
    out = []
    for dname, dtype in DTYPES.items():
        for h in hidden:
            for rows in rows_set:
                if left() < reserve:  # keep the time part (b) needs
                    rec = {"part": "crossover", "dtype": dname, "hidden": h, "rows": rows,
                           "skipped": "out of time"}
                    log(rec)
                    out.append(rec)
                    continue
                x = torch.randn(rows, h, device="cuda", dtype=dtype)
                for vname, (mode, offset, has_w) in VARIANTS.items():
                    w = (torch.randn(h, device="cuda", dtype=dtype).requires_grad_()
                         if has_w else None)
                    rec = {"part": "crossover", "dtype": dname, "hidden": h, "rows": rows,
                           "elements": rows * h, "variant": vname}
                    for path in ("kernels", "torch"):
                        with OPTIONS.override(eager_dispatch=path):
                            rec[f"{path}_eager_us"] = _call_us(x, w, mode, offset, measure,
                                                               repeats)
                            rec[f"{path}_device_us"] = _call_us(x, w, mode, offset, graph_time,
                                                                10)
                    with OPTIONS.override(eager_dispatch="auto"):
                        rec["auto_picks"] = "torch" if _prefer_torch(x) else "kernels"
                    rec["best"] = ("kernels" if rec["kernels_eager_us"] <= rec["torch_eager_us"]
                                   else "torch")
                    log(rec)
                    out.append(rec)
                del x
                torch.cuda.empty_cache()
    return out


def _llama(quick: bool):
    import transformers

    cfg = dict(LLAMA_1B)
    if quick:
        cfg.update(num_hidden_layers=2, hidden_size=512, intermediate_size=1408,
                   num_attention_heads=8, num_key_value_heads=8)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**cfg)
    with torch.device("cuda"):
        return transformers.LlamaForCausalLM(config)


def _stepper(model, ids, compiled: bool):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    fwd = torch.compile(model) if compiled else model

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _paired(a, b, window: int, rounds: int, warmup: int) -> dict:
    """Alternating windows of ``window`` steps of a and b (order swapped every round);
    medians of ms per step and of the per-round ratio a/b."""
    for _ in range(warmup):
        a()
        b()
    _sync()
    ta, tb = [], []
    for r in range(rounds):
        for which in ((a, ta), (b, tb)) if r % 2 == 0 else ((b, tb), (a, ta)):
            fn, acc = which
            _sync()
            t0 = time.perf_counter()
            for _ in range(window):
                fn()
            _sync()
            acc.append((time.perf_counter() - t0) / window * 1e3)
    ratios = [x / y for x, y in zip(ta, tb)]
    return {"a_ms": statistics.median(ta), "b_ms": statistics.median(tb),
            "ratio_a_over_b": statistics.median(ratios), "rounds": rounds, "window": window}


def llama_steps(quick: bool, compile_too: bool, log, left) -> list[dict]:
    batch, seq = (2, 128) if quick else (8, 1024)
    ids = torch.randint(0, 32000, (batch, seq), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    window, rounds, warmup = (2, 2, 1) if quick else (5, 6, 3)
    out = []

    def pair(name_a, make_a, name_b, make_b, compiled=False, needs=30.0):
        if left() < needs:
            rec = {"part": "llama", "a": name_a, "b": name_b, "skipped": "out of time"}
            log(rec)
            out.append(rec)
            return
        model_a, model_b = make_a(), make_b()
        if isinstance(model_a, str):
            rec = {"part": "llama", "a": name_a, "b": name_b, "skipped": model_a}
        else:
            rec = {"part": "llama", "a": name_a, "b": name_b, "compiled": compiled,
                   "batch": f"{batch}x{seq}",
                   **_paired(_stepper(model_a, ids, compiled), _stepper(model_b, ids, compiled),
                             window, rounds, warmup + (2 if compiled else 0))}
        log(rec)
        out.append(rec)
        del model_a, model_b
        gc.collect()
        torch.cuda.empty_cache()
        torch._dynamo.reset()

    def unswapped():
        return _llama(quick)

    def swapped():
        model = _llama(quick)
        tritonnorm.replace_rms_norms(model)
        return model

    def liger():
        """Liger-Kernel's RMSNorm patch alone, or why it could not run. The patch also
        replaces LlamaRMSNorm in transformers' module: undone at once, so that the models
        built after this one keep Hugging Face's norm."""
        from transformers.models.llama import modeling_llama

        try:
            from liger_kernel.transformers import apply_liger_kernel_to_llama
        except ImportError as err:
            return f"liger_kernel does not import ({err})"
        original, model = modeling_llama.LlamaRMSNorm, _llama(quick)
        try:
            apply_liger_kernel_to_llama(rope=False, cross_entropy=False, rms_norm=True,
                                        fused_linear_cross_entropy=False, swiglu=False,
                                        model=model)
        except Exception as err:  # noqa: BLE001 - another Liger or transformers: say so
            return f"apply_liger_kernel_to_llama failed: {err}"
        finally:
            modeling_llama.LlamaRMSNorm = original
        return model

    pair("unswapped", unswapped, "tritonnorm", swapped)
    if compile_too:
        pair("compiled unswapped", unswapped, "compiled tritonnorm", swapped, compiled=True,
             needs=150.0)
    pair("liger", liger, "tritonnorm", swapped)
    return out


def markdown(records: list[dict], env: dict) -> str:
    cross = [r for r in records if r["part"] == "crossover"]
    llama = [r for r in records if r["part"] == "llama"]
    us = {f"{p}_{k}_us": f"{p} {k}" for k in ("eager", "device") for p in ("kernels", "torch")}
    return "\n".join([
        f"# tritonnorm on {env['device']} (torch {env['torch']}, triton {env['triton']}, "
        f"transformers {env['transformers']})", "",
        "## (a) Eager fwd+bwd per call, kernels vs F.rms_norm (µs)", "",
        markdown_table(cross, ["dtype", "hidden", "rows", "variant", *us, "best", "auto_picks",
                               "skipped"], ".1f", headers=us),
        "## (b) HF Llama ~1B training step (ms; x = first / second, paired)", "",
        markdown_table(llama, ["a", "b", "a_ms", "b_ms", "ratio_a_over_b", "skipped"],
                       {"a_ms": ".2f", "b_ms": ".2f", "ratio_a_over_b": ".3f"},
                       headers={"a": "first", "b": "second", "a_ms": "first ms",
                                "b_ms": "second ms", "ratio_a_over_b": "x"})])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for the results")
    parser.add_argument("--quick", action="store_true", help="a few small cells: a smoke test")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled pair")
    parser.add_argument("--skip", choices=("crossover", "llama"), action="append", default=[])
    parser.add_argument("--budget-s", type=float, default=340.0,
                        help="wall-clock limit: parts not started by then are left out")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("h200_hf.py needs a CUDA GPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    import transformers
    import triton

    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "transformers": transformers.__version__,
           "tritonnorm": tritonnorm.__version__, "torch_below": dict(OPTIONS.torch_below)}
    records: list[dict] = []
    t0 = time.perf_counter()
    left = budget(args.budget_s)
    # What part (b) needs: two eager pairs, and the compiled pair's two compilations.
    reserve = 0.0 if "llama" in args.skip else 60.0 + (0.0 if args.no_compile else 150.0)

    def log(rec):
        print(json.dumps(rec), flush=True)

    if "crossover" not in args.skip:
        records += crossover(args.quick, log, left, reserve)
    if "llama" not in args.skip:
        records += llama_steps(args.quick, not args.no_compile, log, left)
    env["seconds"] = round(time.perf_counter() - t0, 1)
    write_jsonl(args.out / "h200_hf.jsonl", [{**r, "env": env} for r in records])
    atomic_write_text(args.out / "h200_hf.md", markdown(records, env))
    print(f"wrote {args.out / 'h200_hf.jsonl'} and {args.out / 'h200_hf.md'} "
          f"in {env['seconds']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
