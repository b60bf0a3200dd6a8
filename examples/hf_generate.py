"""Generate with a Hugging Face model whose attention runs on mhagen's kernels.

A LLaMA-style model with a random config (no downloads: grouped K/V heads, rotary
embeddings) is made twice with the same weights: one stays on Hugging Face's `sdpa`
attention, the other goes through `mhagen.hf.optimize`, which replaces each attention
module by the whole layer fused in mhagen's kernels (projections, rotary, attention, output
projection) and gives generate() mhagen's K/V cache. Both generate greedily from the same
left-padded prompts: the tokens must be the same (exits 1 if not), and each model's
tokens/s is printed (the median of --repeat timed runs after one warm-up).

Run: python examples/hf_generate.py [--d-model 512] [--layers 4] [--heads 8]
     [--kv-heads 2] [--prompt 64] [--new-tokens 32] [--batch 1] [--repeat 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time


def make_models(args):
    """(the sdpa model, the same weights optimized, optimize's report)."""
    import torch
    import transformers

    import mhagen.hf

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.d_model, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        intermediate_size=args.d_model * 8 // 3, max_position_embeddings=4096,
        attn_implementation="sdpa")
    torch.manual_seed(0)
    sdpa = transformers.LlamaForCausalLM(config).eval()
    fused = transformers.LlamaForCausalLM(config).eval()
    fused.load_state_dict(sdpa.state_dict())
    report = mhagen.hf.optimize(fused, max_seq_len=args.prompt + args.new_tokens,
                                batch=args.batch)
    return sdpa, fused, report


def prompts(args):
    """Random token ids [batch, prompt], each row after the first padded on the left by a
    few tokens (attention_mask 0), as a tokenizer with padding_side='left' gives them."""
    import torch
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, args.vocab, (args.batch, args.prompt), generator=g)
    mask = torch.ones_like(ids)
    for row in range(1, args.batch):
        mask[row, :min(row * 3, args.prompt - 1)] = 0
    return ids, mask


def timed_generate(model, ids, mask, args):
    """(generated ids, median seconds of --repeat runs after a warm-up)."""
    import torch
    run = dict(attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False,
               min_new_tokens=args.new_tokens, pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(ids, **run)
        seconds = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            model.generate(ids, **run)
            seconds.append(time.perf_counter() - start)
    return out, statistics.median(seconds)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)

    sdpa, fused, report = make_models(args)
    print(report)
    ids, mask = prompts(args)
    expected, sdpa_s = timed_generate(sdpa, ids, mask, args)
    got, fused_s = timed_generate(fused, ids, mask, args)
    tokens = args.batch * args.new_tokens
    print(f"prompt {args.prompt} x batch {args.batch}, {args.new_tokens} new tokens, greedy:")
    print(f"  HF sdpa:               {tokens / sdpa_s:8.1f} tokens/s ({sdpa_s * 1e3:.1f} ms)")
    print(f"  mhagen.hf.optimize:    {tokens / fused_s:8.1f} tokens/s ({fused_s * 1e3:.1f} ms)"
          f"  {sdpa_s / fused_s:.2f}x")
    print(f"  first tokens: {got[0, args.prompt:args.prompt + 8].tolist()}")
    if not (got.shape == expected.shape and bool((got == expected).all())):
        print("MISMATCH: the optimized model generated other tokens than HF's sdpa")
        return 1
    print("same tokens as HF's sdpa: yes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
