"""Import stage 3b, the fallback: fit a layer's weights by least squares on probe runs.

Used only when the weights cannot be read exactly from the initializers (recover.py). Each
projection is an affine map token by token, solved in float64 over many probe runs of the
model, with the tensors around the attention exposed. The fit refuses to guess: when the
probe rows of the layer input do not span every direction (e.g. token ids from a small
sample), it raises an OnnxError saying how to give more varied inputs.
"""
from __future__ import annotations

import numpy as np

from mhagen.onnx._common import OnnxError
from mhagen.onnx.spec import Recovered, core_heads

VARIED_INPUTS_HINT = ("pass more varied sample_inputs= to import_onnx (a list of dicts, e.g. "
                      "several batches of different token ids), so the probe rows span the "
                      "layer input")


class Design:
    """Least squares y ~ x @ w (+ b) over token rows in float64, one SVD of x for all fits.
    Raises OnnxError when x (with the intercept column) is rank-deficient."""

    def __init__(self, x, intercept, what):
        self.a = np.hstack([x, np.ones((x.shape[0], 1))]) if intercept else x
        self.width, self.intercept = x.shape[1], intercept
        u, sv, vt = np.linalg.svd(self.a, full_matrices=False)
        tiny = sv[0] * max(self.a.shape) * np.finfo(np.float64).eps if sv.size else 0.0
        rank = int(np.sum(sv > max(tiny, 1e-9 * (sv[0] if sv.size else 0.0))))
        if rank < self.a.shape[1]:
            raise OnnxError(f"{what}: the probe rows span {rank} of the {self.a.shape[1]} "
                            "directions the least-squares fit needs, so the weights are not "
                            f"determined (the fit would be silently wrong); {VARIED_INPUTS_HINT}")
        self.u, self.sv, self.vt = u, sv, vt

    def fit(self, y, what):
        sol = self.vt.T @ ((self.u.T @ y) / self.sv[:, None])
        resid = float(np.max(np.abs(self.a @ sol - y))) if y.size else 0.0
        scale = max(float(np.max(np.abs(y))) if y.size else 0.0, 1e-30)
        if resid > 1e-4 * scale + 1e-6:
            raise OnnxError(f"{what} is not an affine function of the layer input token by "
                            f"token (residual {resid:.2g} of {scale:.2g}): positional or rotary "
                            "embeddings, or a non-linear op, sit between them; not supported")
        w = sol[:self.width]
        b = sol[self.width] if self.intercept else np.zeros(y.shape[1])
        return w, b


def bsd(a, layout):
    """A [batch, seq, D] view of a layer tensor in `layout`."""
    return np.swapaxes(a, 0, 1) if layout == "SBD" else a


def probe_runs(blk, prober, shapes, first, rng, specs):
    """Enough probe runs (first included) for well-conditioned fits: 3x the unknowns."""
    x0 = first[blk.x]
    tokens = x0.shape[0] * x0.shape[1]
    feats = sum(s.n_heads * s.head_dim for s in specs)
    need = 3 * max(x0.shape[-1] + 1, feats + 1)
    return [first] + [prober.run(shapes, rng) for _ in range(-(-need // tokens) - 1)]


def fit_block(blk, runs, specs, batch) -> Recovered:
    """Weights of layer `blk` fitted over `runs` (probe values)."""
    d_model = runs[0][blk.x].shape[-1]
    xs = np.concatenate([bsd(v[blk.x], blk.layout).reshape(-1, d_model) for v in runs])
    label = blk.cores[0].label
    designs = {}
    heads = {"q": [], "k": [], "v": []}
    o_cols = []
    for c, spec in zip(blk.cores, specs):
        per_run = [core_heads(c, vals, batch) for vals in runs]
        for role, idx in (("q", 0), ("k", 1), ("v", 2)):
            intercept = c.paths[role].has_bias or bool(c.qkv_bias)
            if intercept not in designs:
                designs[intercept] = Design(xs, intercept, f"{label}: the layer input "
                                                           f"{blk.x!r}")
            heads[role] += _fit_heads(designs[intercept], per_run, idx, spec,
                                      spec.factors.get(role, 1.0), f"{c.label}: {role.upper()}")
        o_cols.append([r[3].transpose(0, 2, 1, 3).reshape(-1, spec.n_heads * spec.head_dim)
                       for r in per_run])
    w_o, b_o = _fit_output(blk, runs, o_cols, label)
    return Recovered(heads["q"], heads["k"], heads["v"], w_o, b_o, "fit", fit_rows=xs)


def _fit_heads(design, per_run, idx, spec, factor, what):
    """[(W [D, d], b [d]) per head] of one role of one core."""
    n, d = spec.n_heads, spec.head_dim
    ys = np.concatenate([r[idx].transpose(0, 2, 1, 3).reshape(-1, n * d) for r in per_run])
    w, b = design.fit(ys, what)
    w = w.reshape(-1, n, d).transpose(1, 0, 2) / factor
    b = b.reshape(n, d) / factor
    return [(w[h], b[h]) for h in range(n)]


def _fit_output(blk, runs, o_cols, label):
    """The output projection, from the observed attention outputs."""
    os_ = np.concatenate([np.concatenate([cols[i] for cols in o_cols], axis=1)
                          for i in range(len(runs))])
    ys = np.concatenate([bsd(v[blk.y], blk.layout).reshape(-1, v[blk.y].shape[-1])
                         for v in runs])
    ok = np.all(np.isfinite(os_), axis=1) & np.all(np.isfinite(ys), axis=1)
    if ok.sum() <= os_.shape[1]:
        raise OnnxError(f"{label}: too few finite outputs to find the output projection "
                        "(fully masked rows give NaN in this model)")
    out_bias = any(c.out.has_bias for c in blk.cores)
    what = f"{label}: the attention output feeding {blk.y!r}"
    return Design(os_[ok], out_bias, what).fit(ys[ok], f"{label}: the output {blk.y!r}")


def unseen_rows(check_x, fit_rows):
    """How many rows of the self-check's layer input the fit did not see."""
    seen = {r.tobytes() for r in np.asarray(fit_rows, np.float64)}
    rows = np.asarray(check_x, np.float64).reshape(-1, check_x.shape[-1])
    return sum(r.tobytes() not in seen for r in rows)
