"""The ``gqa`` ONNX form: a decoding layer (``mhagen.mha(..., kv_cache=N)``) as ONNX Runtime's
``com.microsoft.GroupQueryAttention``, each batch row with its own cache length.

Model (``export_onnx(layer, path, w, form="gqa")``):

    inputs   x                      [batch, seq, d_model]           the layer's dtype
             past_key, past_value   [batch, kv_heads, N, head_dim]  the cache dtype (N = kv_cache)
             seqlens_k              int32 [batch]   tokens in row b after the call, minus 1
             total_sequence_length  int32 []        the longest row after the call
             query_seqlens          int32 [batch]   new tokens of row b (causal layers only)
    outputs  y                      [batch, seq, d_model]
             present_key, present_value  [batch, kv_heads, N, head_dim]

The past is mhagen's whole cache buffer (``cache.k``, ``cache.v``): GroupQueryAttention's
"static" cache, where row b holds its ``lens[b]`` cached tokens at the front and the call writes
the new ones behind them. Bind ``present_*`` to the same buffer as ``past_*`` (IO binding) and
onnxruntime appends in place, as mhagen's kernels do; with ``session.run`` the present is a
fresh copy of the buffer. New tokens are right-padded: row b's first ``query_seqlens[b]`` rows
of x are real, the rest padding (their output rows are unspecified). ``gqa_feeds`` builds the
inputs from a ``mhagen.KVCache`` and ``gqa_step`` runs one call in place.

The node: Q, K and V projections as one MatMul (+ Add) with packed QKV columns, then
GroupQueryAttention (``num_heads``, ``kv_num_heads``, ``scale``; ``causal``;
``local_window_size`` for a causal sliding window, the same count as
``mhagen.sliding_window(W)``: a query sees its W most recent keys, itself included;
``softcap``; ``do_rotary`` with ``cos_cache``/``sin_cache`` [N, rotary_dim / 2] from mhagen's
float64 tables, half-split layout, ``rotary_interleaved=0``), then the output MatMul (+ Add).
Rotary embeddings the op's tables cannot hold (head_dim or rotary_dim not a multiple of 16)
and every layer with a float16 cache rotate Q and K in the graph instead (the positions from
``seqlens_k`` and ``query_seqlens``), and a float16 cache gets its new K/V rows rounded to
float16 before the op reads them, as mhagen's kernels read them from the cache. The op caps
the scaled scores (softcap) and then adds ``attention_bias`` [batch, num_heads, seq,
total_sequence_length]: a score modifier score + f or softcap(c) then + f (ALiBi, T5's
relative buckets) has f computed in the graph at each row's absolute positions.

Refused, with the reason (gqa_plan): layers without a cache, head_dim not a multiple of 8,
bfloat16 caches (no CPU kernel), masks other than none / causal / a causal sliding window
(per-head, per-row or q_len-dependent ones included), score modifiers other than the forms
above (a bias before the cap, a product with the score, an infinite bias), K/V sharing other
than h // (num_heads / kv_heads).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mhagen.call_checks import check_cu_seqlens
from mhagen.dtypes import numpy_dtype
from mhagen.errors import InputError
from mhagen.inputs import LENGTHS, argument
from mhagen.ir import expr as ex
from mhagen.ir import rope
from mhagen.ir.graph import Graph
from mhagen.ir.heads import kv_head_map
from mhagen.ir.numpy_ops import NUMPY_OPS
from mhagen.kvcache import KVCache
from mhagen.onnx._common import OnnxError, need_onnx

#: cache dtypes onnxruntime's CPU GroupQueryAttention reads with float32 Q/K/V
CACHE_DTYPES = ("float32", "float16")
_MASK_BLOCK = 1 << 22     # grid cells per block when a mask is checked cell by cell
_GRID_MAX_LEN = 8192      # the largest cache whose every position pair a mask is read at


@dataclass(frozen=True)
class GQAPlan:
    """What the GroupQueryAttention node of a decoding layer carries (see gqa_plan)."""
    num_heads: int
    kv_heads: int
    head_dim: int
    max_len: int
    scale: float
    causal: bool
    window: int | None           # local_window_size (mhagen.sliding_window's W), or None
    softcap: float | None
    bias: object                 # an expression added after softcap (attention_bias), or None
    rotary: dict | None          # {base, rotary_dim}
    rotary_in_op: bool           # do_rotary with cos/sin caches (else rotated in the graph)
    cache_dtype: str
    q_cols: list                 # (weight, head, bias) of each query head, in order
    k_cols: list                 # ... of each K/V head (the cache's order)
    v_cols: list


def gqa_plan(layer: Graph, fused) -> GQAPlan:
    """The GroupQueryAttention parameters of decoding layer `layer` (``fused``: its fused
    view, input -> qkv_projection -> attention -> output_projection), or OnnxError saying
    why the contract cannot carry it."""
    name = layer.name
    by_kind = {n.kind: n for n in fused.nodes}
    qkv, att = by_kind["qkv_projection"], by_kind["attention"]
    cache = att.attrs.get("cache")
    if cache is None:
        raise OnnxError(f"form='gqa' exports decoding layers (GroupQueryAttention reads and "
                        f"writes a K/V cache); {name!r} keeps none: build it with "
                        "mhagen.mha(..., kv_cache=N), or export it with form='fused'")
    d = att.attrs["head_dim"]
    if d % 8:
        raise OnnxError(f"decoding layer {name!r} has head_dim {d}; GroupQueryAttention needs a "
                        "multiple of 8 (onnxruntime refuses others): use form='fused'")
    cache_dtype = cache.get("dtype", "float32")
    if cache_dtype not in CACHE_DTYPES:
        raise OnnxError(f"decoding layer {name!r} keeps a {cache_dtype} cache; onnxruntime's "
                        "CPU GroupQueryAttention has no kernel reading one beside float32 "
                        "Q/K/V (float32 and float16 caches only): build it with "
                        "cache_dtype='float16' or 'float32'")
    q_off, k_off, v_off = (att.attrs[a] for a in ("q_offsets", "k_offsets", "v_offsets"))
    n_heads = len(q_off)
    k_order = list(dict.fromkeys(k_off))       # cache head g: the g-th K offset to appear
    kv_heads = len(k_order)
    pairs = {k: v for k, v in zip(k_off, v_off)}
    grouped = (n_heads % kv_heads == 0 and len(set(zip(k_off, v_off))) == kv_heads and
               [k_order.index(k) for k in k_off] == kv_head_map(n_heads, kv_heads))
    if not grouped:
        raise OnnxError(f"decoding layer {name!r}: query heads read K/V heads "
                        f"{[k_order.index(k) for k in k_off]}; GroupQueryAttention gives query "
                        f"head h the K/V head h // (num_heads / kv_heads) only")
    segs = {i * d: s for i, s in enumerate(qkv.attrs["segments"])}
    if {int(s["width"]) for s in segs.values()} != {d}:
        raise OnnxError(f"decoding layer {name!r}: qkv segments are not all {d} wide, as "
                        "GroupQueryAttention's heads are")

    def cols(offsets):
        return [(segs[o]["weight"], segs[o]["head"], segs[o].get("bias")) for o in offsets]

    max_len = int(cache["max_len"])
    causal, window = _attention_pattern(att.attrs.get("mask"), max_len, name)
    softcap, bias = _score_terms(att.attrs.get("score_mod"), name)
    scale = float(att.attrs["scale"])
    if not scale > 0:     # the op reads 0 as its default 1/sqrt(head_dim)
        raise OnnxError(f"decoding layer {name!r} scales its scores by {scale:.6g}; "
                        "GroupQueryAttention takes a positive scale only")
    rotary = att.attrs.get("rotary")
    rotary_in_op = (rotary is not None and d % 16 == 0 and rotary["rotary_dim"] % 16 == 0
                    and cache_dtype == "float32")
    return GQAPlan(n_heads, kv_heads, d, max_len, scale, causal, window, softcap, bias, rotary,
                   rotary_in_op, cache_dtype, cols(q_off), cols(k_order),
                   cols([pairs[k] for k in k_order]))


def _attention_pattern(mask, max_len: int, name: str) -> tuple[bool, int | None]:
    """(causal, window) of a decoding layer's mask: no mask, causal, or a causal sliding window
    of W keys -- what GroupQueryAttention's ``causal`` and ``local_window_size`` say. The
    cache's own rule kv_idx < kv_len is what the op's per-row lengths say."""
    cache_rule = ex.kv_idx < ex.kv_len
    terms, todo = [], [mask] if mask is not None else []
    while todo:
        t = todo.pop()
        if isinstance(t, ex.BinOp) and t.op == "&":
            todo += [t.rhs, t.lhs]
        elif t != cache_rule and t not in terms:
            terms.append(t)
    if not terms:
        return False, None
    rest = set().union(*(ex.variables(t) for t in terms))
    why = {"batch": "differs per batch row", "head": "differs per head",
           "q_len": "reads q_len (the call's new-token count)",
           "kv_len": "reads kv_len beyond the cache's own kv_idx < kv_len"}
    for var in ("batch", "head", "q_len", "kv_len"):
        if var in rest:
            raise OnnxError(f"decoding layer {name!r} has mask {mask!r}, which {why[var]}; "
                            "GroupQueryAttention masks causally and with a causal sliding "
                            "window (local_window_size) only")
    causal = ex.causal()
    windows = [_window_of(t) for t in terms if t != causal]
    if causal in terms and None not in windows:     # causal & q_idx - kv_idx < W ...
        w = min(windows, default=None)
        return True, (w if w is not None and w < max_len else None)
    return _pattern_from_grid(_conjunction(terms), mask, max_len, name)


def _window_of(term) -> int | None:
    """W of the term (q_idx - kv_idx) < W (mhagen.sliding_window's), else None."""
    if (isinstance(term, ex.BinOp) and term.op == "<" and isinstance(term.rhs, ex.Const)
            and isinstance(term.rhs.value, int) and term.rhs.value >= 1
            and term.lhs == (ex.q_idx - ex.kv_idx)):
        return term.rhs.value
    return None


def _conjunction(terms):
    out = terms[0]
    for t in terms[1:]:
        out = out & t
    return out


def _pattern_from_grid(expr, mask, max_len, name):
    """(causal, window) by evaluating `expr` (of q_idx and kv_idx) at every position pair of
    the cache, in blocks of query rows: no mask, causal, or causal with the window the last
    position's row shows; OnnxError if it is none of them."""
    if max_len > _GRID_MAX_LEN:
        raise OnnxError(f"decoding layer {name!r} has mask {mask!r}, written otherwise than "
                        f"causal=True and mhagen.sliding_window(W); such a mask is read at "
                        f"every position pair, up to kv_cache={_GRID_MAX_LEN} "
                        f"(this one: {max_len}): write it with those")
    kv = np.arange(max_len)[None, :]

    def rows(q):
        return np.broadcast_to(ex.evaluate(expr, {"q_idx": q, "kv_idx": kv}, NUMPY_OPS),
                               (q.shape[0], max_len)).astype(bool)
    seen = int(rows(np.array([[max_len - 1]])).sum())      # the last query's W recent keys
    w = seen if 0 < seen < max_len else None
    alive = {(False, None): lambda q: np.ones((1, 1), bool),
             (True, w): lambda q: (kv <= q) & (q - kv < (w or max_len))}
    step = max(1, _MASK_BLOCK // max_len)
    for start in range(0, max_len, step):
        q = np.arange(start, min(start + step, max_len))[:, None]
        got = rows(q)
        alive = {k: want for k, want in alive.items()
                 if np.array_equal(got, np.broadcast_to(want(q), got.shape))}
        if not alive:
            raise OnnxError(f"decoding layer {name!r} has mask {mask!r}; GroupQueryAttention "
                            "masks causally (causal=1), with a causal sliding window "
                            "(local_window_size: mhagen.sliding_window(W)) or not at all, "
                            "and nothing else")
    return next(iter(alive))


def _score_terms(score_mod, name: str):
    """(softcap, bias) of a decoding layer's score modifier: GroupQueryAttention caps the
    scaled scores (softcap), then adds attention_bias, so it carries softcap(c), score + f,
    and softcap(c) then + f (mhagen.combine(mhagen.softcap(c), f)), with f an expression of
    the positions and head without the score (ALiBi, T5's buckets...); OnnxError otherwise."""
    if score_mod is None:
        return None, None
    cap = _cap_of(score_mod)
    if cap is not None:
        return cap, None
    if isinstance(score_mod, ex.BinOp) and score_mod.op == "+":
        for capped, bias in ((score_mod.lhs, score_mod.rhs), (score_mod.rhs, score_mod.lhs)):
            if "score" in ex.variables(bias):
                continue
            cap = None if capped == ex.score else _cap_of(capped)
            if capped == ex.score or cap is not None:
                _check_finite(bias, score_mod, name)
                return cap, bias
    raise OnnxError(f"decoding layer {name!r} has score modifier {score_mod!r}; "
                    "GroupQueryAttention caps the scaled scores (softcap) and then adds a bias "
                    "(attention_bias), so it carries mhagen.softcap(c), score + f and "
                    "combine(softcap(c), f) with f free of the score (ALiBi: alibi(num_heads))"
                    " -- not this one (a bias before the cap, a product with the score...)")


def _cap_of(expr) -> float | None:
    """c when expr is exactly mhagen.softcap(c)'s expression, else None."""
    if (isinstance(expr, ex.BinOp) and expr.op == "*" and isinstance(expr.lhs, ex.Const)
            and expr.lhs.value > 0 and expr == ex.softcap(float(expr.lhs.value))):
        return float(expr.lhs.value)
    return None


def _check_finite(bias, score_mod, name):
    """A bias that can be infinite could hide every key of a row: mhagen gives such a row
    zeros, the op does not."""
    for e in ex.subexpressions(bias):
        values = [e.value] if isinstance(e, ex.Const) else list(getattr(e, "values", []))
        if not all(np.isfinite(values)):
            raise OnnxError(f"decoding layer {name!r} has score modifier {score_mod!r}, whose "
                            "bias can be infinite: a row whose keys it all hides is zeros "
                            "in mhagen and not in GroupQueryAttention; hide keys with a mask "
                            "(causal, sliding_window) instead")


# -- the ONNX graph -----------------------------------------------------------------------
def build_gqa(b, layer: Graph, w: dict, fused) -> str:
    """Add the gqa form of decoding layer `layer` to builder `b` (mhagen.onnx.export's
    _Builder); returns y's tensor."""
    p = gqa_plan(layer, fused)
    tp = b.onnx.TensorProto
    d = p.head_dim
    by_kind = {n.kind: n for n in fused.nodes}
    out = by_kind["output_projection"]

    cols = p.q_cols + p.k_cols + p.v_cols
    wt = np.concatenate([w[wn][h] for wn, h, _ in cols], axis=1)
    qkv = b.op("MatMul", [b.x, b.weight("w_qkv", wt)],
               "qkv_matmul" if any(bn for _, _, bn in cols) else "qkv")
    if any(bn for _, _, bn in cols):
        bias = np.concatenate([w[bn][h] if bn else np.zeros(d, np.float32)
                               for _, h, bn in cols])
        qkv = b.op("Add", [qkv, b.weight("b_qkv", bias)], "qkv")

    cache_elem = b.elem_type(p.cache_dtype)
    buffer = [b.batch, p.kv_heads, p.max_len, d]
    past_k, past_v, present_k, present_v = (b.fresh(n) for n in (
        "past_key", "past_value", "present_key", "present_value"))
    seqlens_k, total = b.fresh("seqlens_k"), b.fresh("total_sequence_length")
    b.extra_inputs += [(past_k, buffer, cache_elem), (past_v, buffer, cache_elem),
                       (seqlens_k, [b.batch], tp.INT32), (total, [], tp.INT32)]
    query_seqlens = ""
    if p.causal:   # onnxruntime's CPU kernel takes per-row new-token counts with causal=1 only
        query_seqlens = b.fresh("query_seqlens")
        b.extra_inputs.append((query_seqlens, [b.batch], tp.INT32))
    b.extra_outputs += [(present_k, buffer, cache_elem), (present_v, buffer, cache_elem)]
    b.domains["com.microsoft"] = 1

    attrs = {"num_heads": p.num_heads, "kv_num_heads": p.kv_heads, "scale": p.scale,
             "causal": int(p.causal)}
    if p.window is not None:
        attrs["local_window_size"] = p.window
    if p.softcap is not None:
        attrs["softcap"] = p.softcap
    tables = ["", ""]
    if p.rotary is not None:
        cos, sin = rope.tables(p.max_len, p.rotary["rotary_dim"], p.rotary["base"])
        tables = [b.init("cos_cache", cos.astype(np.float32)),
                  b.init("sin_cache", sin.astype(np.float32))]
    if p.rotary_in_op:
        attrs.update(do_rotary=1, rotary_interleaved=0)
        q_k_v = [qkv, "", ""]                              # packed QKV
    else:
        hq, hk = p.num_heads * d, p.kv_heads * d
        q, k, v = (b.op("Slice", [qkv, b.i64(lo), b.i64(hi), b.i64(-1)], role)
                   for lo, hi, role in ((0, hq, "q"), (hq, hq + hk, "k"),
                                        (hq + hk, hq + 2 * hk, "v")))
        if p.rotary is not None:   # padding rows may point past the tables: clipped
            pos = b.op("Clip", [_positions(b, seqlens_k, total, query_seqlens),
                                b.const(0, np.int64), b.const(p.max_len - 1, np.int64)],
                       "positions_in_cache")
            cos_sin = [b.op("Unsqueeze", [b.op("Gather", [t, pos], f"{t}_at", axis=0),
                                          b.i64(2)], f"{t}_rows") for t in tables]
            q, k = (_rotate(b, t, heads, d, p.rotary["rotary_dim"], cos_sin, role)
                    for t, heads, role in ((q, p.num_heads, "q"), (k, p.kv_heads, "k")))
        if p.cache_dtype != "float32":   # the new rows as the cache stores them
            k, v = (b.op("Cast", [b.op("Cast", [t], f"{t}_{p.cache_dtype}", to=cache_elem)],
                         f"{t}_rounded", to=tp.FLOAT) for t in (k, v))
        q_k_v, tables = [q, k, v], ["", ""]
    given = dict(enumerate(q_k_v + [past_k, past_v, seqlens_k, total] + tables))
    if p.bias is not None:
        given[10] = _bias(b, p, seqlens_k, total, query_seqlens)       # attention_bias
    if query_seqlens:
        given[16] = query_seqlens
    ins = [given.get(i, "") for i in range(max(i for i, t in given.items() if t) + 1)]
    y = b.fresh("attention")
    b.nodes.append(b.h.make_node("GroupQueryAttention", ins, [y, present_k, present_v],
                                 name=y, domain="com.microsoft", **attrs))
    wo = b.weight(out.attrs["weight"], w[out.attrs["weight"]])
    y = b.op("MatMul", [y, wo], "out_matmul" if out.attrs.get("bias") else "out")
    if out.attrs.get("bias"):
        y = b.op("Add", [y, b.weight(out.attrs["bias"], w[out.attrs["bias"]])], "out")
    return y


def _positions(b, seqlens_k, total, query_seqlens) -> str:
    """int64 [batch, seq]: the absolute position of each new token, as the op places it:
    P + s, with P = seqlens_k + 1 - query_seqlens (the tokens cached before the call);
    without query_seqlens P = seqlens_k + 1 - seq, or 0 for a first prompt (seq equal to
    total_sequence_length)."""
    def make():
        i64 = b.onnx.TensorProto.INT64
        seq = b.dim(1)
        if query_seqlens:
            before = b.op("Sub", [_row_total(b, seqlens_k), b.op(
                "Cast", [query_seqlens], "query_seqlens_i64", to=i64)], "row_past")
        else:
            first = b.op("Equal", [_total(b, total), seq], "first_prompt")
            before = b.op("Where", [first, b.const(0, np.int64), b.op(
                "Sub", [_row_total(b, seqlens_k), seq], "row_past_rest")], "row_past")
        steps = b.op("Range", [b.const(0, np.int64), seq, b.const(1, np.int64)], "new_token")
        return b.op("Add", [b.op("Unsqueeze", [before, b.i64(1)], "row_past_col"), steps],
                    "positions")
    return b.cached("gqa_positions", make)


def _row_total(b, seqlens_k) -> str:
    """int64 [batch]: each row's tokens after the call (seqlens_k + 1)."""
    return b.cached("row_total", lambda: b.op("Add", [b.op(
        "Cast", [seqlens_k], "seqlens_k_i64", to=b.onnx.TensorProto.INT64),
        b.const(1, np.int64)], "row_total"))


def _total(b, total) -> str:
    """total_sequence_length as an int64 scalar."""
    return b.cached("total_i64", lambda: b.op("Cast", [total], "total_i64",
                                              to=b.onnx.TensorProto.INT64))


def _bias(b, p, seqlens_k, total, query_seqlens) -> str:
    """attention_bias [batch, num_heads, seq, total_sequence_length] float32: the score
    modifier's bias at each row's absolute positions (query P + s, key j)."""
    seq = b.dim(1)

    def index(name):
        def make():
            if name == "q_idx":
                return b.op("Unsqueeze", [_positions(b, seqlens_k, total, query_seqlens),
                                          b.i64(1, 3)], "bias_q_idx")
            if name == "kv_idx":
                return b.op("Reshape", [b.op("Range", [b.const(0, np.int64), _total(b, total),
                                                       b.const(1, np.int64)], "key_range"),
                                        b.i64(1, 1, 1, -1)], "bias_kv_idx")
            if name == "kv_len":
                return b.op("Reshape", [_row_total(b, seqlens_k), b.i64(-1, 1, 1, 1)],
                            "bias_kv_len")
            if name == "batch":
                return b.op("Reshape", [b.op("Range", [b.const(0, np.int64), b.dim(0),
                                                       b.const(1, np.int64)], "batch_range"),
                                        b.i64(-1, 1, 1, 1)], "bias_batch")
            if name == "head":
                return b.const(np.arange(p.num_heads, dtype=np.int64).reshape(1, -1, 1, 1),
                               np.int64)
            if name == "q_len":
                return seq
            raise OnnxError(f"expression variable {name!r} cannot be exported")
        return b.cached(("bias_index", name), make)

    bias = b.score_mod(p.bias, None, None, "bias", index=index)
    shape = b.op("Concat", [b.op("Unsqueeze", [t, b.i64(0)], f"bias_dim{i}") for i, t in
                            enumerate((b.dim(0), b.const(p.num_heads, np.int64), seq,
                                       _total(b, total)))], "bias_shape", axis=0)
    return b.op("Expand", [bias, shape], "attention_bias")


def _rotate(b, t, heads, d, rotary_dim, cos_sin, role) -> str:
    """RoPE on t [batch, seq, heads * d] at the gathered tables cos_sin ([batch, seq, 1,
    rotary_dim / 2] each): the half-split layout of mhagen/ir/rope.py."""
    split = b.op("Reshape", [t, b.i64(0, 0, heads, d)], f"{role}_heads")
    rotated = b.rotary(split, d, rotary_dim, None, f"r{role}", tables=cos_sin)
    return b.op("Reshape", [rotated, b.i64(0, 0, heads * d)], f"r{role}_flat")


# -- running an exported model on a mhagen KVCache -----------------------------------------
def gqa_feeds(cache, x, new_tokens=None, *, cu_seqlens=None, inputs=None) -> dict:
    """The inputs of a form='gqa' model for one decoding call on `cache` (a mhagen.KVCache in
    the state before the call), as numpy arrays for ``session.run(None, feeds)``.

    Args:
        cache: the layer's KVCache; ``past_key``/``past_value`` are its buffers (the run's
            ``present_key``/``present_value`` are the buffers after the call: copy them back
            into cache.k/cache.v and add the new tokens to cache.lens, or use gqa_step).
        x: [batch, seq, d_model] new tokens, right-padded: row b's first new_tokens[b]
            are real; or, with cu_seqlens, the packed tokens [1, total, d_model]. In the
            layer's dtype (float64 is passed as float32; gqa_step converts any float).
        new_tokens: int [batch], row b's new tokens (0 for a row that adds none); default
            seq for every row.
        cu_seqlens: [batch + 1] offsets of each row's tokens in a packed x (as mhagen's
            packed calls take them); x is then padded to [batch, max new tokens, d_model].
        inputs: the model's input names (``[i.name for i in session.get_inputs()]``): only
            those are returned (a non-causal layer's model has no query_seqlens).
    """
    if not isinstance(cache, KVCache):
        raise InputError(f"gqa_feeds() takes a mhagen.KVCache, got {type(cache).__name__}")
    x = np.asarray(x)
    if x.ndim != 3 or not np.issubdtype(x.dtype, np.floating) and x.dtype.kind != "V":
        raise InputError(f"x must be a float array [batch, seq, d_model], got "
                         f"{x.dtype} {x.shape}")
    batch = cache.batch
    if cu_seqlens is not None:
        if new_tokens is not None:
            raise InputError("give new_tokens= or cu_seqlens=, not both (cu_seqlens says "
                             "each row's count)")
        if x.shape[0] != 1:
            raise InputError(f"with cu_seqlens, x is the packed tokens [1, total, d_model]; "
                             f"got {x.shape}")
        cu = check_cu_seqlens(cu_seqlens, x.shape[1], sequences=batch)
        counts = np.diff(cu).astype(np.int32)
        padded = np.zeros((batch, max(int(counts.max()), 1), x.shape[2]), x.dtype)
        for r in range(batch):
            padded[r, :counts[r]] = x[0, cu[r]:cu[r + 1]]
        x = padded
    elif x.shape[0] != batch:
        raise InputError(f"x has {x.shape[0]} rows; the cache holds {batch}")
    seq = x.shape[1]
    if new_tokens is None and cu_seqlens is None:
        counts = np.full(batch, seq, np.int32)
    elif new_tokens is not None:
        counts = np.array(argument(new_tokens, "new_tokens", need=LENGTHS, expects="[batch]"),
                          dtype=np.int32).reshape(-1)
        if counts.shape != (batch,):
            raise InputError(f"new_tokens needs one count per row ({batch}), got "
                             f"{counts.shape[0]}")
        if counts.min(initial=0) < 0 or counts.max(initial=0) > seq:
            raise InputError(f"new_tokens must be within 0..{seq} (x's seq), got "
                             f"{counts.tolist()}")
    lens = np.asarray(cache.lens, dtype=np.int64)
    # an idle row on an empty cache is told it holds 1 token (seqlens_k cannot be -1)
    held = np.where((counts == 0) & (lens == 0), 1, lens)
    if lens.min(initial=0) < 0 or (held + seq).max(initial=0) > cache.max_len:
        raise InputError(f"the cache holds {lens.tolist()} tokens per row and each row gets a "
                         f"padded chunk of {seq}: GroupQueryAttention needs lens + {seq} <= "
                         f"{cache.max_len} (max_len) in every row, padding included; reset "
                         "the cache or build with a larger kv_cache=")
    after = lens + counts
    names = set(inputs) if inputs is not None else None
    first_prompt = not lens.any()
    if names is not None and "query_seqlens" not in names and not first_prompt and (
            (counts != seq).any() or (seq > 1 and batch > 1)):
        raise InputError(f"this model has no query_seqlens input (a non-causal layer), so "
                         f"onnxruntime reads each row's new tokens from seqlens_k alone: with "
                         f"tokens cached (lens {lens.tolist()}) every row adds all {seq} of "
                         f"x's tokens, and more than one at batch 1 only; new_tokens "
                         f"{counts.tolist()} is not that (a first call on an empty cache may "
                         "mix counts)")
    feeds = {"x": x.astype(np.float32) if x.dtype == np.float64 else x,
             "past_key": cache.k, "past_value": cache.v,
             # an idle row (no new token) on an empty cache: any valid index, its rows unread
             "seqlens_k": np.maximum(after - 1, 0).astype(np.int32),
             "total_sequence_length": np.array(max(int(after.max(initial=0)), seq), np.int32),
             "query_seqlens": counts.astype(np.int32)}
    return feeds if names is None else {k: v for k, v in feeds.items() if k in names}


def gqa_binding(session, cache, x, new_tokens=None, *, cu_seqlens=None):
    """(binding, y): an onnxruntime IOBinding of one call of a form='gqa' model on `cache`,
    with past and present bound to cache.k and cache.v themselves (onnxruntime appends the
    new K/V rows in place), and y [batch, seq, d_model] the array the output goes to.
    ``session.run_with_iobinding(binding)`` runs it (again and again, for timing: each run
    writes the same rows); it does not advance cache.lens (gqa_step does)."""
    import onnxruntime as ort
    names = [i.name for i in session.get_inputs()]
    feeds = gqa_feeds(cache, x, new_tokens, cu_seqlens=cu_seqlens, inputs=names)
    given = {i.name: i for i in session.get_inputs()}
    for name, past in (("k", given["past_key"]), ("v", given["past_value"])):
        a = getattr(cache, name)
        want = [d if isinstance(d, int) else a.shape[i] for i, d in enumerate(past.shape)]
        if a.dtype != _numpy_type(past.type) or list(a.shape) != want:
            raise InputError(f"cache.{name} is {a.dtype} {list(a.shape)}; this model's past "
                             f"is {past.type} {past.shape}: make the cache with "
                             "mhagen.KVCache.empty(layer, batch) of the exported layer")
        if not (a.flags.c_contiguous and a.flags.writeable):
            raise InputError(f"cache.{name} must be a writable C-contiguous array "
                             "(onnxruntime writes it in place); make the cache with "
                             "mhagen.KVCache.empty(layer, batch)")
    x_type = _numpy_type(given["x"].type)
    feeds["x"] = np.ascontiguousarray(np.asarray(feeds["x"]).astype(x_type, copy=False))
    out = session.get_outputs()[0]
    d_out = out.shape[-1] if isinstance(out.shape[-1], int) else feeds["x"].shape[2]
    y = np.empty(feeds["x"].shape[:2] + (d_out,), _numpy_type(out.type))
    binding = session.io_binding()
    for name, value in feeds.items():
        if name not in ("past_key", "past_value"):
            binding.bind_ortvalue_input(name, _ort_value(ort, np.asarray(value, order="C")))
    for past, present, a in (("past_key", "present_key", cache.k),
                             ("past_value", "present_value", cache.v)):
        buffer = _ort_value(ort, a)
        binding.bind_ortvalue_input(past, buffer)
        binding.bind_ortvalue_output(present, buffer)
    binding.bind_ortvalue_output(out.name, _ort_value(ort, y))
    return binding, y


def _ort_value(ort, a):
    """An OrtValue over numpy array `a`'s memory (onnxruntime's numpy bridge has no
    bfloat16: such arrays go as their bits)."""
    if a.dtype == numpy_dtype("bfloat16"):
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
            a.view(np.uint16), need_onnx().TensorProto.BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(a)


def _numpy_type(onnxruntime_type: str):
    """The numpy dtype of an onnxruntime tensor type string ('tensor(float16)')."""
    return numpy_dtype({"tensor(float)": "float32", "tensor(float16)": "float16",
                        "tensor(bfloat16)": "bfloat16"}[onnxruntime_type])


def gqa_step(session, cache, x, new_tokens=None, *, cu_seqlens=None) -> np.ndarray:
    """One decoding call of a form='gqa' model in onnxruntime, as a mhagen module call on
    `cache`: writes the new K/V rows into cache.k/cache.v in place, advances cache.lens by
    each row's new tokens and returns y -- [batch, seq, d_model] with the padding rows
    zeroed, or the packed [1, total, d_model] when cu_seqlens is given."""
    binding, y = gqa_binding(session, cache, x, new_tokens, cu_seqlens=cu_seqlens)
    session.run_with_iobinding(binding)
    batch, seq = y.shape[:2]
    if cu_seqlens is not None:
        cu = np.asarray(cu_seqlens, dtype=np.int64).reshape(-1)
        counts = np.diff(cu)
        packed = np.concatenate([y[r, :counts[r]] for r in range(batch)])[None]
        cache.lens += counts.astype(cache.lens.dtype)
        return packed
    counts = np.full(batch, seq) if new_tokens is None else np.asarray(new_tokens).reshape(-1)
    for r in range(batch):
        y[r, counts[r]:] = 0
    cache.lens += counts.astype(cache.lens.dtype)
    return y
