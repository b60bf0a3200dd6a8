#!/usr/bin/env python
"""Benchmark whole Hugging Face models with their attention on Hugging Face's own kernels
and on mhagen's, in one process.

Models (random configs, float32, batch 1; no downloads):
  llama   LLaMA-style: d_model 2048, 16 heads, 4 K/V heads, MLP 5632, vocab 32000 (TinyLlama's
          widths with 16 heads), --layers layers (default 2)
  gpt2    GPT-2-style: 768 wide, 12 heads, MLP 3072, vocab 50257
  bert    BERT-base width (768, 12 heads, MLP 3072; an encoder: prefill only). optimize runs
          it where a family covers BertSelfAttention (mhagen/hf/seq2seq.py), else that row
          says why it is missing
Implementations, each on the same weights:
  hf_eager, hf_sdpa       attn_implementation "eager" / "sdpa" (one model, switched)
  hf_mhagen               attn_implementation="mhagen" (mhagen.hf.interface: the attention
                          core on mhagen's kernels); left out with a note where this
                          checkout has no mhagen/hf/interface.py
  optimize                mhagen.hf.optimize on a copy: the whole attention layer fused,
                          mhagen's K/V cache
Cases:
  prefill P       one forward of P tokens (a new cache; logits of the last token only, as
                  generate's prefill): time per token = time / P
  decode P+N      N decode steps after a prompt of P tokens (the prompt untimed): every
                  implementation is fed the tokens hf_sdpa chose greedily (teacher forcing),
                  time per step = the median step; `llama` also at a 2048-token cache
                  (P = 2048 - N)
Every output is checked against hf_sdpa's before timing counts: the prefill's logits at
every position, each decode step's logits (max |difference| <= 1e-4 + 1e-4 max|hf_sdpa|;
a failing implementation is reported and left out). "attention" is the time spent inside
the attention modules (forward hooks on every implementation's attention modules, whose
two clock reads per call are in every row), "share" its part of the whole.
Implementations alternate in rounds (rotating order, an idle gap before each turn at 2
threads so the other pools' threads stop spinning); medians over rounds.

Run: python benchmarks/bench_hf.py [--quick] [--models llama,gpt2,bert] [--layers 2]
         [--threads 1,2] [--prefill 512] [--steps 128] [--rounds 2] [--out DIR]
"""
from __future__ import annotations

import argparse
import copy
import importlib
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_mha as bm  # noqa: E402  (threads, CPU summary, result files)

import mhagen  # noqa: E402
import mhagen.hf  # noqa: E402

IMPLS = ("hf_eager", "hf_sdpa", "hf_mhagen", "optimize")
TARGETS = {"decode": 0.8, "prefill": 0.9, "attention": 0.6}    # issue 57, LLaMA, 2 threads


def configs(quick: bool, layers: int) -> dict:
    """name -> (transformers class name, config, decoder?)."""
    import transformers as T
    if quick:
        return {
            "llama": ("LlamaForCausalLM", T.LlamaConfig(
                vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
                True),
            "gpt2": ("GPT2LMHeadModel", T.GPT2Config(vocab_size=256, n_embd=64, n_layer=2,
                                                     n_head=4, n_positions=256), True),
            "bert": ("BertModel", T.BertConfig(vocab_size=256, hidden_size=64,
                                               num_hidden_layers=2, num_attention_heads=4,
                                               intermediate_size=128,
                                               max_position_embeddings=256), False),
        }
    return {
        "llama": ("LlamaForCausalLM", T.LlamaConfig(
            vocab_size=32000, hidden_size=2048, intermediate_size=5632,
            num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
            max_position_embeddings=4096), True),
        "gpt2": ("GPT2LMHeadModel", T.GPT2Config(vocab_size=50257, n_embd=768, n_layer=layers,
                                                 n_head=12, n_positions=4096), True),
        "bert": ("BertModel", T.BertConfig(vocab_size=30522, hidden_size=768,
                                           num_hidden_layers=layers, num_attention_heads=12,
                                           intermediate_size=3072,
                                           max_position_embeddings=4096), False),
    }


class AttentionClock:
    """Seconds spent inside the attention modules of a model (forward pre/post hooks)."""

    def __init__(self, modules):
        self.seconds, self._start = 0.0, []
        self.handles = []
        for m in modules:
            self.handles.append(m.register_forward_pre_hook(self._enter))
            self.handles.append(m.register_forward_hook(self._leave))

    def _enter(self, module, args):
        self._start.append(time.perf_counter())

    def _leave(self, module, args, output):
        self.seconds += time.perf_counter() - self._start.pop()


def attention_modules(model) -> list:
    """The modules optimize replaces (or has replaced): a family's class, a FusedAttention;
    an encoder's *SelfAttention where no family covers it."""
    from mhagen.hf.optimizer import FAMILIES, FusedAttention   # (the families registered)
    return [m for m in model.modules()
            if isinstance(m, FusedAttention) or type(m).__name__ in FAMILIES
            or type(m).__name__.endswith("SelfAttention")]


class Impl:
    """One implementation of one model: its module, which attention implementation it runs,
    whether it decodes (a causal LM with a cache) and the clock on its attention modules."""

    def __init__(self, name, model, clock, attn=None, decoder=True):
        self.name, self.model, self.attn, self.decoder = name, model, attn, decoder
        self.clock = clock           # shared by the implementations of one model object

    def forward(self, ids, cache=None, keep=0):
        """A decoder's forward on a cache (None: a new one), logits of the last `keep`
        tokens (0: all); an encoder's forward."""
        import torch
        if self.attn is not None and self.model.config._attn_implementation != self.attn:
            self.model.set_attn_implementation(self.attn)
        with torch.inference_mode():
            if not self.decoder:
                return self.model(ids)
            return self.model(ids, cache=cache, use_cache=True, logits_to_keep=keep)


def make_impls(name, cls_name, config, decoder, max_len, status):
    """{impl name: Impl} for one model; what cannot run goes into status."""
    import torch
    import transformers
    torch.manual_seed(0)
    config._attn_implementation = "sdpa"
    hf = getattr(transformers, cls_name)(config).eval()
    out = {}
    opt = copy.deepcopy(hf)
    clock = AttentionClock(attention_modules(hf))
    out["hf_eager"] = Impl("hf_eager", hf, clock, "eager", decoder)
    out["hf_sdpa"] = Impl("hf_sdpa", hf, clock, "sdpa", decoder)
    try:
        importlib.import_module("mhagen.hf.interface")   # attn_implementation="mhagen"
        mhagen.hf.register()
        out["hf_mhagen"] = Impl("hf_mhagen", hf, clock, "mhagen", decoder)
    except ImportError as err:
        status[f"{name} hf_mhagen"] = (f"left out: attn_implementation='mhagen' is not in this "
                                       f"checkout ({err})")
    try:
        start = time.perf_counter()
        report = mhagen.hf.optimize(opt, max_seq_len=max_len, batch=1)
        status[f"{name} optimize"] = (f"{len(report.replaced)} modules, {report.configurations} "
                                      f"configuration(s), built in "
                                      f"{time.perf_counter() - start:.1f} s")
        out["optimize"] = Impl("optimize", opt, AttentionClock(attention_modules(opt)), None,
                               decoder)
    except mhagen.InputError as err:
        status[f"{name} optimize"] = f"left out: {err}"
    return out


def tolerance(reference) -> float:
    return 1e-4 + 1e-4 * float(reference.abs().max())


def check(impls, reference_fn, label, status):
    """Keep the implementations whose output equals hf_sdpa's within tolerance."""
    want = reference_fn(impls["hf_sdpa"])
    kept = {}
    for name, impl in impls.items():
        got = want if name == "hf_sdpa" else reference_fn(impl)
        err = float((got - want).abs().max())
        tol = tolerance(want)
        if err <= tol:
            kept[name] = impl
            status[f"{label} {name}"] = f"checked: max error {err:.2e} (tolerance {tol:.2e})"
        else:
            status[f"{label} {name}"] = (f"excluded: max error {err:.3g} > tolerance "
                                         f"{tol:.3g} against hf_sdpa")
    return kept


def prefill_case(impls, ids, rounds, gap_s, label, status):
    """name -> (seconds, attention seconds) of one forward of ids (a new cache each)."""
    def logits(impl):
        out = impl.forward(ids)
        return (out.logits if impl.decoder else out.last_hidden_state).float()
    checked = check(impls, logits, label, status)
    samples = {n: [] for n in checked}
    names = list(checked)
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            impl = checked[n]
            time.sleep(gap_s)
            impl.forward(ids, keep=1)                       # warm-up
            impl.clock.seconds = 0.0
            start = time.perf_counter()
            impl.forward(ids, keep=1)
            samples[n].append((time.perf_counter() - start, impl.clock.seconds))
    return samples


def decode_case(impls, prompt, steps, rounds, gap_s, label, status):
    """name -> [(median step seconds, median attention seconds per step)] per round, the
    steps fed hf_sdpa's greedy tokens (teacher forcing), each step's logits checked."""
    import torch
    ref = impls["hf_sdpa"]
    out = ref.forward(prompt, keep=1)
    cache, tokens, want = out.cache, [], []
    nxt = out.logits[:, -1:].argmax(-1)
    for _ in range(steps):
        tokens.append(nxt)
        out = ref.forward(nxt, cache=cache, keep=1)
        want.append(out.logits[:, -1].float())
        nxt = out.logits[:, -1:].argmax(-1)

    def run(impl, collect=False, times=None):
        out = impl.forward(prompt, keep=1)
        cache, got = out.cache, []
        for token in tokens:
            impl.clock.seconds = 0.0
            start = time.perf_counter()
            out = impl.forward(token, cache=cache, keep=1)
            if times is not None:
                times.append((time.perf_counter() - start, impl.clock.seconds))
            if collect:
                got.append(out.logits[:, -1].float())
        return torch.stack(got) if collect else None

    reference = torch.stack(want)
    checked = check(impls, lambda impl: reference if impl is ref else run(impl, True),
                    label, status)
    samples = {n: [] for n in checked}
    names = list(checked)
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            time.sleep(gap_s)
            times = []
            run(checked[n], times=times)
            samples[n].append((statistics.median(t for t, _ in times),
                               statistics.median(a for _, a in times)))
    return samples


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny models, prefill 32, 8 steps, "
                   "1 thread, 1 round: a smoke run")
    p.add_argument("--models", default="llama,gpt2,bert")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--long-cache", type=int, default=2048,
                   help="llama's second decode case ends at this cache length (0: none)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--gap-ms", type=float, default=bm.GAP_MS)
    p.add_argument("--out", type=Path, help="write results.json and results.md here")
    args = p.parse_args(argv)
    if args.quick:
        args.threads, args.prefill, args.steps, args.rounds = "1", 32, 8, 1
        args.long_cache = 64
    import torch
    rows, status = [], {}
    models = [m for m in args.models.split(",") if m]
    table = configs(args.quick, args.layers)
    unknown = sorted(set(models) - set(table))
    if unknown:
        p.error(f"--models {','.join(unknown)}: choose among {', '.join(table)}")
    for threads in [int(t) for t in args.threads.split(",")]:
        bm.set_threads(threads)
        gap_s = args.gap_ms / 1e3 if threads > 1 else 0.0
        for model in models:
            cls_name, config, decoder = table[model]
            cases = [("prefill", args.prefill, 0)]
            if decoder:
                cases.append(("decode", args.prefill, args.steps))
                if model == "llama" and args.long_cache:
                    cases.append(("decode", args.long_cache - args.steps, args.steps))
            max_len = max(p_ + s for _, p_, s in cases)
            impls = make_impls(model, cls_name, config, decoder, max_len, status)
            g = torch.Generator().manual_seed(1)
            for kind, prompt_len, steps in cases:
                ids = torch.randint(3, config.vocab_size, (1, prompt_len), generator=g)
                label = (f"{model} {kind} {prompt_len}" + (f"+{steps}" if steps else "")
                         + f" at {threads} thread{'s' * (threads > 1)}")
                if kind == "prefill":
                    samples = prefill_case(impls, ids, args.rounds, gap_s, label, status)
                    per = prompt_len
                else:
                    samples = decode_case(impls, ids, steps, args.rounds, gap_s, label, status)
                    per = 1
                med = {n: (statistics.median(t for t, _ in s) / per,
                           statistics.median(a for _, a in s) / per)
                       for n, s in samples.items()}
                base = med.get("hf_sdpa")
                for n, (t, a) in med.items():
                    rows.append({"model": model, "case": kind, "prompt": prompt_len,
                                 "steps": steps, "threads": threads, "impl": n,
                                 "ms_per_token": t * 1e3, "attention_ms_per_token": a * 1e3,
                                 "attention_share": a / t,
                                 "vs_sdpa": t / base[0] if base else None,
                                 "attention_vs_sdpa": a / base[1] if base and base[1] else
                                 None})
            del impls
    meta = {"cpu": bm.cpu_summary(), "status": status, "quick": args.quick,
            "layers": args.layers, "torch": torch.__version__,
            "env": {k: os.environ[k] for k in ("TVM_NUM_THREADS", "OMP_NUM_THREADS",
                                               "TVM_THREAD_POOL_SPIN_COUNT") if k in os.environ}}
    text = markdown(rows, meta)
    print(text)
    if args.out:
        bm.save_results(args.out, {"meta": meta, "rows": rows}, text)
    return 0


def markdown(rows, meta) -> str:
    lines = ["| model | case | threads | impl | ms/token | attention ms/token | share | "
             "/ sdpa | attention / sdpa |", "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        case = (f"prefill {r['prompt']}" if r["case"] == "prefill" else
                f"decode {r['prompt']}+{r['steps']}")
        ratio = "—" if r["vs_sdpa"] is None else f"{r['vs_sdpa']:.2f}"
        aratio = "—" if r["attention_vs_sdpa"] is None else f"{r['attention_vs_sdpa']:.2f}"
        lines.append(f"| {r['model']} | {case} | {r['threads']} | {r['impl']} | "
                     f"{r['ms_per_token']:.3f} | {r['attention_ms_per_token']:.3f} | "
                     f"{100 * r['attention_share']:.0f}% | {ratio} | {aratio} |")
    lines.append("")
    targets = target_lines(rows)
    if targets:
        lines += ["Issue 57's targets (llama, optimize vs hf_sdpa, 2 threads):", *targets, ""]
    lines += [f"- {k}: {v}" for k, v in meta["status"].items()]
    lines.append(f"- CPU: {meta['cpu']}; torch {meta['torch']}")
    if meta["env"]:
        lines.append(f"- environment: {meta['env']}")
    return "\n".join(lines)


def target_lines(rows) -> list:
    """Issue 57's targets for optimize on llama at 2 threads, where the run has the rows."""
    def row(case, prompt=None):
        for r in rows:
            if (r["model"], r["impl"], r["threads"], r["case"]) == ("llama", "optimize", 2,
                                                                   case) and \
                    (prompt is None or r["prompt"] + r["steps"] == prompt):
                return r
        return None
    out = []
    long = max((r["prompt"] + r["steps"] for r in rows if r["case"] == "decode"
                and r["model"] == "llama"), default=None)
    checks = [("decode step at a %s-token cache" % long, row("decode", long), "vs_sdpa",
               TARGETS["decode"]),
              ("prefill", row("prefill"), "vs_sdpa", TARGETS["prefill"]),
              ("attention modules, decode at %s" % long, row("decode", long),
               "attention_vs_sdpa", TARGETS["attention"]),
              ("attention modules, prefill", row("prefill"), "attention_vs_sdpa",
               TARGETS["attention"])]
    for what, r, key, goal in checks:
        if r is not None and r[key] is not None:
            met = "met" if r[key] <= goal else "missed"
            out.append(f"- {what}: {r[key]:.2f}x (target <= {goal}x): {met}")
    return out


if __name__ == "__main__":
    sys.exit(main())
