"""Why multi-head attention has several heads: each head learns to look somewhere else.

A 2-head layer reads the 6-token sentence "the cat sat on the mat". Its weights are written
by hand, not trained, so that
  head A ("previous") attends to the 1-2 tokens before the query token, and
  head B ("first")    attends to the first token, whatever the query position.
The heads can disagree because each owns its projections W_Q[h], W_K[h], W_V[h]: the same
input x is read through different matrices, so each head scores different pairs of tokens.
Concatenating the heads and projecting with W_O then merges the two views: here W_O routes
head A's result to output dims 0-4 and head B's to dims 5-9, so every output vector says
both "which tokens came just before me" and "which token opened the sentence".

Embedding: x = [one-hot token (5) | one-hot position (6) | zeros (5)], d_model = 16.
Softmax always sums to 1, so a head with nothing to look at still looks somewhere: position 0
has no previous token, so head A's query 0 is made to match key 0 and rests on itself.

Run: python examples/heads_specialise.py [--out-dir DIR]
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

import mhagen
from mhagen.reference import run_reference

SENTENCE = "the cat sat on the mat".split()
VOCAB = ["the", "cat", "sat", "on", "mat"]
V, S, D = len(VOCAB), len(SENTENCE), 16     # vocabulary, sequence length, d_model
HEAD_DIM = D // 2                           # 2 heads of 8 dims
POS = V                                     # x[POS + i] is the one-hot of position i
SHARP = 10.0                                # logit gap between a matching and another key
HEAD_A, HEAD_B = 0, 1
TOKEN_THRESHOLD = 0.25                      # a token "is encoded" above this weight


def make_layer():
    return mhagen.mha(D, 2, head_dim=HEAD_DIM, bias=True)


def embed(tokens=SENTENCE) -> np.ndarray:
    """x [1, S, D]: one-hot token identity followed by one-hot position."""
    x = np.zeros((1, len(tokens), D), np.float32)
    for i, tok in enumerate(tokens):
        x[0, i, VOCAB.index(tok)] = 1.0
        x[0, i, POS + i] = 1.0
    return x


def make_weights(layer) -> dict:
    w = {k: np.zeros_like(v) for k, v in layer.init_weights(0).items()}
    q_gain = SHARP * math.sqrt(HEAD_DIM)    # the layer divides scores by sqrt(head_dim)

    # Head A: query i is e_i; key j is e_{j+1} + e_{j+2}; so query i matches keys i-1, i-2.
    for i in range(S):
        w["w_q"][HEAD_A, POS + i, i] = q_gain
        for m in (i + 1, i + 2):
            if m < S:
                w["w_k"][HEAD_A, POS + i, m] = 1.0
    w["w_k"][HEAD_A, POS + 0, 0] = 1.0      # fallback: query 0 matches key 0 (itself)

    # Head B: a constant query (bias only) that matches only the key of position 0.
    w["b_q"][HEAD_B, 0] = q_gain
    w["w_k"][HEAD_B, POS + 0, 0] = 1.0

    # Both heads carry the token identity as their value.
    for h in (HEAD_A, HEAD_B):
        for t in range(V):
            w["w_v"][h, t, t] = 1.0
    # W_O: concat = [head A (8) | head B (8)] -> output dims 0-4 (prev) and 5-9 (first).
    for t in range(V):
        w["w_o"][HEAD_A * HEAD_DIM + t, t] = 1.0
        w["w_o"][HEAD_B * HEAD_DIM + t, V + t] = 1.0
    return w


def attention_maps(layer, x, w) -> tuple[np.ndarray, np.ndarray]:
    """Head A's and head B's attention maps [S, S] (rows: query, cols: key), from the oracle."""
    vals = run_reference(layer, x, w, return_all=True)
    return vals[f"p{HEAD_A}"][0], vals[f"p{HEAD_B}"][0]


def compiled_maps(kernel, x) -> tuple[np.ndarray, np.ndarray]:
    """The same maps from the compiled layer (module.attention_maps: [batch, heads, S, S])."""
    p = kernel.attention_maps(x)
    return p[0, HEAD_A], p[0, HEAD_B]


def decode(y: np.ndarray) -> list[tuple[list[str], str]]:
    """Per position of y [1, S, D]: (tokens in the 'prev' part, argmax of the 'first' part)."""
    out = []
    for vec in y[0]:
        prev = [VOCAB[t] for t in range(V) if vec[t] > TOKEN_THRESHOLD]
        out.append((prev, VOCAB[int(np.argmax(vec[V:2 * V]))]))
    return out


def format_map(name: str, p: np.ndarray) -> str:
    labels = [f"{i}:{t}" for i, t in enumerate(SENTENCE)]
    lines = [f"{name} (rows = query, cols = key)", " " * 7 + "".join(f"{s:>7}" for s in labels)]
    for label, row in zip(labels, p):
        lines.append(f"{label:<7}" + "".join(f"{v:7.2f}" for v in row))
    return "\n".join(lines)


def save_png(maps, titles, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    labels = [f"{i}:{t}" for i, t in enumerate(SENTENCE)]
    for ax, p, title in zip(axes, maps, titles):
        ax.imshow(p, vmin=0, vmax=1, cmap="viridis")
        ax.set_title(title)
        ax.set_xticks(range(S), labels, rotation=45)
        ax.set_yticks(range(S), labels)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def run(out_dir=None) -> dict:
    """Build, check and analyse the layer; returns everything main() prints."""
    layer, x = make_layer(), embed()
    w = make_weights(layer)
    kernel = mhagen.build(layer, target="x86", batch=1, seq_len=S, weights=w)
    y = kernel(x)
    error = mhagen.max_error(y, layer.reference(x, w))
    # The maps come from the compiled layer, checked against the float64 oracle's.
    map_a, map_b = compiled_maps(kernel, x)
    ref_a, ref_b = attention_maps(layer, x, w)
    error = max(error, mhagen.max_error(map_a, ref_a), mhagen.max_error(map_b, ref_b))
    png = None
    if out_dir is not None:
        png = Path(out_dir) / "heads_specialise.png"
        if not save_png((map_a, map_b), ("head A: previous tokens", "head B: first token"), png):
            png = None
    return {"error": error, "map_a": map_a, "map_b": map_b, "y": y, "decoded": decode(y),
            "png": png}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parents[1] / "build"),
                    help="where to write heads_specialise.png (default: build/)")
    args = ap.parse_args(argv)

    r = run(args.out_dir)
    print(f"sentence: {' '.join(SENTENCE)}")
    print(f"compiled (x86) output and attention maps vs float64 reference: max error "
          f"{r['error']:.2e}")
    if not r["error"] < 1e-4:
        print("FAIL: error >= 1e-4", file=sys.stderr)
        return 1
    print()
    print(format_map("head A: previous tokens", r["map_a"]))
    print("  (position 0 has no previous token: head A rests on the token itself)")
    print()
    print(format_map("head B: first token", r["map_b"]))
    print()
    print("png (from the compiled layer's maps): " +
          (str(r["png"]) if r["png"] else "skipped (matplotlib is not installed)"))
    print()
    print("concat + W_O: output dims 0-4 = head A's view, dims 5-9 = head B's view")
    for i, (prev, first) in enumerate(r["decoded"]):
        tok = f"'{SENTENCE[i]}'"
        note = "  (itself: no previous token)" if i == 0 else ""
        print(f"  pos {i} {tok:<6}: prev -> {{{', '.join(prev)}}}  first -> {first}{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
