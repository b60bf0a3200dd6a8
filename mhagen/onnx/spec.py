"""Import stage 2, reading a matched core from probe values: its heads (Q/K/V/O split per
head), its scale and its masks (a band ``lo <= kv_idx - q_idx <= hi`` per head).

Masks are read from the constant (input-independent) tensors that feed the scores --
additive (0 / -inf, or values <= -1e4 taken as -inf) or boolean -- the same for every batch
element. Score modifiers read too: the finite part of the additive tensors when it is a
linear distance bias per head, slope_h * (kv_idx - q_idx) plus anything constant along a row
(ALiBi, in the form BLOOM writes it, slope_h * kv_idx, as well), and softcapping,
c * tanh(s / c) (Div, Tanh, Mul in the score chain).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mhagen.ir import expr as ex
from mhagen.ir import rope
from mhagen.ir.heads import kv_head_map
from mhagen.onnx._common import OnnxError, fewest_kv_heads

NEG_LIMIT = -1e4          # additive mask values at or below this count as -inf


@dataclass
class CoreSpec:
    """What one core computes, per query head."""
    n_heads: int
    head_dim: int
    scale: float                 # the layer's score scale (factors on Q and K divided out)
    factors: dict                # role -> constant factor applied to Q/K after their bias
    bands: list                  # per query head: (causal, other mask expression or None)
    lead: tuple                  # leading dims of the scores ("lead" layout), else ()
    k: np.ndarray                # [B, H, T, d] K per query head (probe values)
    v: np.ndarray
    cap: float | None = None     # softcap c: c * tanh(scaled score / c)
    slopes: list | None = None   # per query head: bias slope_h * (kv_idx - q_idx)
    distances: list | None = None  # per query head: a learned bias per distance, values over
    #                                -(T-1)..T-1 at the probe's T keys (T5-style relative bias)
    rotary: tuple | None = None  # (base, rotary_dim) of rotary embeddings on Q and K


@dataclass
class Recovered:
    """A layer's weights in mhagen's per-head layout, and how they were found."""
    q: list                      # per query head: (W [D, d], b [d])
    k: list                      # per query head (grouped heads repeat their K/V head's)
    v: list
    w_o: np.ndarray              # [H * d, D_out]
    b_o: np.ndarray              # [D_out]
    source: str                  # "initializers" (read exactly) or "fit" (least squares)
    detail: str = ""             # why the fit was needed
    fit_rows: np.ndarray | None = None   # layer-input rows the fit saw


# -- heads ---------------------------------------------------------------------------------
def split_heads(c, q, k, v, batch, qkv_bias=None):
    """Q [B,H,S,d], K and V [B,H,T,d] (K/V repeated per query head) from the core's inputs
    in its own layout; and the leading dims of the scores (lead layout). Works on any
    array type, so index arrays follow the same moves as values."""
    if c.layout == "lead":
        return _split_lead(c, q, k, v, batch)
    if qkv_bias is not None:
        nq, nk = q.shape[-1], k.shape[-1]
        if k.ndim != 3 or qkv_bias.shape != (nq + nk + v.shape[-1],):
            raise OnnxError(f"{c.label}: bias {qkv_bias.shape} does not match query/key/value")
        q, k, v = q + qkv_bias[:nq], k + qkv_bias[nq:nq + nk], v + qkv_bias[nq + nk:]
    if q.ndim == 3:
        if not c.q_heads or not c.kv_heads:
            raise OnnxError(f"{c.label}: 3D Q/K/V need q_num_heads and kv_num_heads")
        if k.ndim != 3 or v.ndim != 3:
            raise OnnxError(f"{c.label}: Q is 3D but K/V are {k.ndim}D; not supported")
        q, k, v = _split3(q, c.q_heads), _split3(k, c.kv_heads), _split3(v, c.kv_heads)
    elif q.ndim != 4:
        raise OnnxError(f"{c.label}: Q is {q.ndim}D; expected 3D or 4D")
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        raise OnnxError(f"{c.label}: {q.shape[1]} query heads and {k.shape[1]} K/V heads")
    head_map = kv_head_map(q.shape[1], k.shape[1])     # K/V per query head
    return q, k[:, head_map], v[:, head_map], ()


def _split3(a, heads):
    b, s, f = a.shape
    return a.reshape(b, s, heads, f // heads).transpose(0, 2, 1, 3)


def _split_lead(c, q, kt, v, batch):
    k = np.swapaxes(kt, -1, -2)
    leads = [a.shape[:-2] for a in (q, k, v)]
    try:
        lead = tuple(np.broadcast_shapes(*leads))
        q, k, v = (np.broadcast_to(a, lead + a.shape[-2:]) for a in (q, k, v))
    except ValueError:
        # one batch-head axis against two (BLOOM: Q K^T on [batch*heads, ...], P V after a
        # Reshape of P to [batch, heads, ...]): the same row-major order, so flattened alike
        if len({int(np.prod(d)) for d in leads}) != 1:
            raise OnnxError(f"{c.label}: Q {q.shape}, K^T {kt.shape} and V {v.shape} do not "
                            "broadcast to one another") from None
        lead = (int(np.prod(leads[0])),)
        q, k, v = (a.reshape(lead + a.shape[-2:]) for a in (q, k, v))
    n = int(np.prod(lead))
    if n % batch:
        raise OnnxError(f"{c.label}: cannot tell heads from batch in {lead}")
    return tuple(a.reshape(batch, n // batch, *a.shape[-2:]) for a in (q, k, v)) + (lead,)


def split_output(c, o, batch):
    """The core's output [B, H, S, dv] from its own layout."""
    if c.layout == "lead":
        n = int(np.prod(o.shape[:-2]))
        if n % batch:
            raise OnnxError(f"{c.label}: cannot tell heads from batch in {o.shape}")
        return o.reshape(batch, n // batch, *o.shape[-2:])
    return _split3(o, c.q_heads) if o.ndim == 3 else o


def core_heads(c, vals, batch):
    """split_heads and split_output of the core's probe values (float64)."""
    q, k, v, o = (np.asarray(vals[t], np.float64) for t in (c.q, c.k, c.v, c.o))
    bias = np.asarray(vals[c.qkv_bias], np.float64) if c.qkv_bias else None
    q, k, v, lead = split_heads(c, q, k, v, batch, bias)
    o = split_output(c, o, batch)
    if lead and o.shape[:2] != q.shape[:2]:
        raise OnnxError(f"{c.label}: Q, K^T and V broadcast to {lead}, but the output is "
                        f"{vals[c.o].shape}")
    return q, k, v, o, lead


# -- scale ---------------------------------------------------------------------------------
def core_scale(c, vals, head_dim):
    """(the layer's scale, {role: constant factor on Q/K}, the softcap or None) for core c.
    A softcap post * tanh(pre * s) is c * tanh(scale * s / c) with c = post and
    scale = pre * post."""
    cap = None
    if c.layout == "lead":
        chain = score_factor_values(c, vals)
        scale = float(np.prod(chain))
        if c.tanh_at is not None:      # the factors after the Tanh multiply the cap
            cap = float(np.prod(chain[c.tanh_at:]))
        if cap is not None and not cap > 0:
            raise OnnxError(f"{c.label}: the softcap's Tanh is multiplied by {cap:.4g}, not "
                            "a positive cap")
    else:
        scale = float(c.scale) if c.scale else 1.0 / math.sqrt(head_dim)
    factors = {}
    for role in ("q", "k"):
        f = 1.0
        for t, e in c.paths[role].factors:
            val = np.asarray(vals[t], np.float64)
            if val.size == 1:
                f *= float(val.reshape(())) ** e
        factors[role] = f
    return scale * factors["q"] * factors["k"], factors, cap


def score_factor_values(c, vals) -> list:
    """The scalar factors of the score chain, in order (Div as its inverse)."""
    out = []
    for t, e in c.score_factors:
        f = np.asarray(vals[t], np.float64)
        if f.size != 1:
            raise OnnxError(f"{c.label}: the scores are multiplied by {t!r} of shape "
                            f"{f.shape}; only a scalar scale is supported")
        out.append(float(f.reshape(())) ** e)
    return out


# -- the whole core ------------------------------------------------------------------------
def read_core(c, vals, batch, notes):
    """The CoreSpec of core c from one probe run's values."""
    q, k, v, o, lead = core_heads(c, vals, batch)
    n_heads, d = q.shape[1], q.shape[-1]
    if k.shape[-1] != d or v.shape[-1] != d:
        raise OnnxError(f"{c.label}: Q/K are {d} wide but V is {v.shape[-1]}; mhagen "
                        "heads have one width")
    check_reshapes(c, vals)
    rank = np.ndim(vals[c.softmax_input]) if c.softmax_input else len(lead) + 2
    if c.softmax_axis is not None and c.softmax_axis not in (-1, rank - 1):
        raise OnnxError(f"{c.label}: Softmax over axis {c.softmax_axis}, not the key "
                        "axis; not supported")
    scale, factors, cap = core_scale(c, vals, d)
    keep, bias = keep_mask(c, vals, lead, (batch, n_heads, q.shape[2], k.shape[2]), notes)
    if not np.all(keep == keep[:1]) or not np.allclose(bias, bias[:1]):
        raise OnnxError(f"{c.label}: the mask differs between batch elements (a padding "
                        "mask?); mhagen masks are functions of positions only")
    try:
        slopes, distances = distance_slopes(c, bias[0], keep[0]), None
    except OnnxError as linear:
        slopes, distances = None, distance_values(c, bias[0], keep[0], linear)
        notes.append(f"a learned relative position bias, read per distance up to "
                     f"{bias.shape[-1] - 1} (the probe length less one); farther distances "
                     "take the last one's value, exact for T5 buckets when the probe is "
                     "longer than the model's max_distance (T5: 128)")
    for zeros in c.nan_guards:
        if np.any(np.asarray(vals[zeros], np.float64) != 0):
            raise OnnxError(f"{c.label}: the probabilities' NaN guard (Where(IsNaN(P), z, P)) "
                            "replaces NaN by a non-zero value; mhagen gives zeros there")
    if (~keep[0].any(axis=-1)).any():
        notes.append("some queries see no key (fully masked rows); mhagen gives zeros there"
                     + ("" if c.zero_rows or c.nan_guards or c.source == "Attention" else
                        " (this ONNX model gives NaN)"))
    return CoreSpec(n_heads, d, scale, factors, [_head_band(c, keep[0, h], h)
                                                for h in range(n_heads)], lead, k, v,
                    cap=cap, slopes=slopes, distances=distances,
                    rotary=read_rotary(c, vals, d))


def read_rotary(c, vals, head_dim):
    """(base, rotary_dim) of the rotary embeddings on the core's Q and K paths
    (match.rotary_parts), read from the probe values of their input x and output y: the
    rotated leading columns, the angle each pair (i, i + r/2) turns at position 1 (atan2 of
    the cross and dot products of x's and y's pairs, summed over rows), the base fitted to
    angle_i = base^(-2i/r), and then y checked to be mhagen's RoPE of x at every position.
    None without rotary embeddings; OnnxError for anything else (rotary on V or on Q or K
    alone, scaled frequencies, positions not from 0)."""
    paths = {r: c.paths[r].rotary for r in "qkv"}
    if not any(paths.values()):
        return None
    if paths["v"] is not None or paths["q"] is None or paths["k"] is None:
        rotated = ", ".join(r.upper() for r in "qkv" if paths[r])
        raise OnnxError(f"{c.label}: rotary embeddings on {rotated} only; mhagen rotates Q "
                        "and K (never V)")
    found = []
    for role in "qk":
        x, y = (np.asarray(vals[t], np.float64) for t in paths[role])
        what = f"{c.label}: the rotary embeddings on {role.upper()} ({paths[role][1]!r})"
        if x.shape != y.shape or x.shape[-1] != head_dim or x.shape[-2] < 2:
            raise OnnxError(f"{what} do not map [..., seq, {head_dim}] to the same shape")
        x, y = x.reshape(-1, x.shape[-2], head_dim), y.reshape(-1, y.shape[-2], head_dim)
        moved = np.flatnonzero(np.any(~np.isclose(x, y, rtol=1e-6, atol=1e-7), axis=(0, 1)))
        r = int(moved[-1]) + 1 if moved.size else 0
        r += r % 2
        if r < 2:
            raise OnnxError(f"{what} rotate nothing")
        h = r // 2

        def turn(t):   # the angle pair i turns by at position t, in (-pi, pi]
            a, b, ya, yb = x[:, t, :h], x[:, t, h:r], y[:, t, :h], y[:, t, h:r]
            return np.arctan2(np.sum(a * yb - b * ya, axis=0), np.sum(a * ya + b * yb, axis=0))
        angle = turn(1)
        if np.any(angle <= 0):
            raise OnnxError(f"{what} do not turn every pair forward at position 1 (positions "
                            "not from 0?); not supported")
        # refined at the last position (t times the angle, unwrapped): slow pairs turn by
        # too little at position 1 for float32 values to tell their angle precisely
        last = x.shape[1] - 1
        wraps = np.round((last * angle - turn(last)) / (2 * np.pi))
        angle = (turn(last) + 2 * np.pi * wraps) / last
        # base from the second pair (angle base^(-2/r): the best determined one)
        base = float(angle[1] ** (-r / 2)) if h > 1 else 10000.0
        if not math.isfinite(base):
            raise OnnxError(f"{what} turn by angles that give no rotary base ({base}); "
                            "not supported")
        whole = float(round(base))        # 10000.0 rather than 9999.9997
        base = whole if abs(base - whole) <= 1e-4 * base else base
        want = rope.apply(x, r, base)
        if not np.allclose(want, y, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(y).max()))):
            raise OnnxError(f"{what} are not angle t * base^(-2i/r) at position t (scaled "
                            "frequencies, as rope_scaling? an offset?); not supported")
        found.append((base, r))
    if found[0] != found[1]:
        raise OnnxError(f"{c.label}: Q and K are rotated differently {found}")
    return found[0]


def distance_slopes(c, bias, keep):
    """Per head h, the slope of a finite additive bias slope_h * (kv_idx - q_idx) + a
    constant per row (which the softmax ignores), read where keys are kept; None for no
    bias; OnnxError for any other bias."""
    if not np.any(bias[keep]):
        return None
    slopes = []
    heads, rows, cols = bias.shape
    j = np.arange(cols)[None, :] - np.arange(rows)[:, None]
    for h in range(heads):
        b, k = bias[h], keep[h]
        pairs = k[:, 1:] & k[:, :-1]
        steps = (b[:, 1:] - b[:, :-1])[pairs]
        slope = float(np.median(steps)) if steps.size else 0.0
        seen = k.any(axis=1)
        rest = np.where(k, b - slope * j, np.nan)[seen]
        spread = np.nanmax(rest, axis=1) - np.nanmin(rest, axis=1) if rest.size else [0.0]
        if np.max(spread) > 1e-4 * (1.0 + np.abs(b[k]).max()):
            raise OnnxError(f"{c.label}: head {h}'s additive bias is not a linear distance "
                            "bias (slope * (kv_idx - q_idx), as ALiBi): learned relative "
                            "position biases are not supported by the importer")
        slopes.append(slope)
    return slopes


def distance_values(c, bias, keep, linear):
    """Per head, the bias as a function of kv_idx - q_idx alone (a learned relative
    position bias, as T5's): values over the distances -(T-1)..T-1, 0 where no kept score
    has that distance; `linear` (the linear fit's error) when some head's bias also depends
    on the position."""
    heads, rows, cols = bias.shape
    span = cols - 1
    if rows != cols:
        raise linear
    j = (np.arange(cols)[None, :] - np.arange(rows)[:, None]).ravel() + span
    out = []
    for h in range(heads):
        b, k = bias[h].ravel(), keep[h].ravel()
        hi = np.full(2 * span + 1, -np.inf)
        lo = np.full(2 * span + 1, np.inf)
        np.maximum.at(hi, j[k], b[k])
        np.minimum.at(lo, j[k], b[k])
        seen = np.isfinite(hi)
        if np.any(hi[seen] - lo[seen] > 1e-4 * (1.0 + np.abs(b[k]).max(initial=0.0))):
            raise OnnxError(f"{c.label}: head {h}'s additive bias is neither a linear distance "
                            "bias (slope * (kv_idx - q_idx), as ALiBi) nor a function of "
                            "kv_idx - q_idx alone (a learned relative position bias, as T5); "
                            "mhagen cannot express it") from None
        out.append(np.where(seen, (hi + lo) / 2, 0.0).tolist())
    return out


def _head_band(c, grid, h):
    try:
        return band(grid)
    except ValueError:
        raise OnnxError(f"{c.label}: the mask of head {h} is not a band (lo <= kv_idx - q_idx "
                        f"<= hi) at seq length {grid.shape[0]}; mhagen cannot express it as a "
                        "mask expression") from None


# -- masks ---------------------------------------------------------------------------------
def check_reshapes(c, vals):
    """Every Reshape of the scores or probabilities keeps the query and key axes and only
    splits or merges the batch-head axes before them (row-major order unchanged), so masks
    on either side read the same [batch, heads] grid."""
    for label, before, after in c.reshapes:
        a, b = np.shape(vals[before]), np.shape(vals[after])
        if len(a) < 3 or len(b) < 3 or a[-2:] != b[-2:]:
            raise OnnxError(f"{c.label}: {label} reshapes the scores {a} -> {b}; mhagen reads "
                            "reshapes of the batch and head axes only (the query and key axes "
                            "kept)")


def keep_mask(c, vals, lead, full, notes):
    """[B, H, S, T] bool: which keys each query sees, from the core's constant masks (each
    broadcast to the scores it is applied to, then seen as [B, H, S, T])."""
    def spread(a, what, scores=None):
        a = np.asarray(a)
        try:
            if scores is not None:
                return np.broadcast_to(a, np.shape(vals[scores])).reshape(full)
            if c.layout == "lead":
                return np.broadcast_to(a, tuple(lead) + full[2:]).reshape(full)
            return np.broadcast_to(a, full)
        except ValueError:
            raise OnnxError(f"{c.label}: {what} of shape {a.shape} does not broadcast to the "
                            f"scores") from None

    keep, bias = np.ones(full, bool), np.zeros(full)
    factors = score_factor_values(c, vals) if c.layout == "lead" else []
    for tensor, sign, at, scores in c.adds:
        a = sign * np.asarray(vals[tensor], np.float64) * float(np.prod(factors[at:]))
        kept, finite = _additive_keep(c, tensor, a, notes)
        keep &= spread(kept, f"mask {tensor!r}", scores)
        bias = bias + spread(finite, f"bias {tensor!r}", scores)
    for cond, other, keep_when_true, scores in c.wheres:
        o = np.asarray(vals[other], np.float64)
        if np.any(o > NEG_LIMIT):
            raise OnnxError(f"{c.label}: Where replaces masked scores by {o.max():.4g}, not "
                            "-inf; not supported")
        cnd = np.asarray(vals[cond]).astype(bool)
        keep &= spread(cnd if keep_when_true else ~cnd, f"condition {cond!r}", scores)
    for mask in c.bool_masks:
        keep &= spread(_attn_mask_keep(c, mask, np.asarray(vals[mask])), f"attn_mask {mask!r}")
    if c.causal:
        keep &= np.tril(np.ones(full[2:], bool))
    for cond, zeros, zero_when_true, probs in c.zero_rows:
        _check_zeroed_rows(c, vals, keep, spread, cond, zeros, zero_when_true, probs)
    return keep, np.where(keep, bias, 0.0)


def _additive_keep(c, tensor, a, notes):
    """(keep, the finite bias where kept) of an additive tensor (-inf or <= NEG_LIMIT:
    masked)."""
    if np.any(a == np.inf) or np.any(np.isnan(a)):
        raise OnnxError(f"{c.label}: additive mask {tensor!r} holds +inf or NaN")
    if np.any(np.isfinite(a) & (a <= NEG_LIMIT)):
        notes.append(f"additive mask {tensor!r}: finite values <= {NEG_LIMIT:g} taken as "
                     "-inf (a fully masked row then averages in ONNX, is zero in mhagen)")
    keep = ~(a <= NEG_LIMIT)
    return keep, np.where(keep, a, 0.0)


def _attn_mask_keep(c, mask, a):
    if a.dtype == bool:
        return a
    bad = np.isfinite(a) & (a != 0) & (a > NEG_LIMIT)
    if bad.any():
        raise OnnxError(f"{c.label}: float attn_mask {mask!r} has values other than 0 "
                        f"and -inf (e.g. {a[bad].flat[0]:.4g}); not supported")
    return ~(a <= NEG_LIMIT)


def _check_zeroed_rows(c, vals, keep, spread, cond, zeros, zero_when_true, probs):
    if np.any(np.asarray(vals[zeros]) != 0):
        raise OnnxError(f"{c.label}: a Where after the Softmax replaces probabilities by "
                        "non-zero values; not supported")
    cnd = np.asarray(vals[cond]).astype(bool)
    z = spread(cnd if zero_when_true else ~cnd, f"condition {cond!r}", probs)
    dead = ~keep.any(axis=-1, keepdims=True)
    if np.any(z & ~dead):
        raise OnnxError(f"{c.label}: a Where after the Softmax zeroes probabilities of rows "
                        "that are not fully masked; not supported")


def band(grid):
    """The mask expression of a [S, T] grid that is a band lo <= kv_idx - q_idx <= hi;
    (causal part, other part) or raises ValueError."""
    s, t = grid.shape
    diff = np.arange(t)[None, :] - np.arange(s)[:, None]
    if grid.all():
        return False, None
    if not grid.any():
        return False, ex.kv_idx < 0
    lo, hi = int(diff[grid].min()), int(diff[grid].max())
    if not np.array_equal(grid, (diff >= lo) & (diff <= hi)):
        raise ValueError("not a band")
    causal = hi == 0
    parts = []
    if hi < t - 1 and not causal:
        parts.append(ex.kv_idx - ex.q_idx <= hi)
    if lo > -(s - 1):
        parts.append(ex.q_idx - ex.kv_idx < 1 - lo)
    other = None
    for p in parts:
        other = p if other is None else other & p
    return causal, other


def kv_heads_of(specs):
    """The fewest K/V heads that explain the probe values (query heads of one group read
    identical K and V)."""
    k_all = np.concatenate([s.k for s in specs], axis=1)
    v_all = np.concatenate([s.v for s in specs], axis=1)
    return fewest_kv_heads(k_all.shape[1], lambda h, f: np.array_equal(
        k_all[:, h], k_all[:, f]) and np.array_equal(v_all[:, h], v_all[:, f]))
