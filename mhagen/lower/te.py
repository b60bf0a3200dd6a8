"""Lower a graph to TVM tensor expressions (TE), one function per node kind, then to a PrimFunc.

Each node becomes one or more TE stages (TIR blocks named after the node). `lower()` reports,
per stage, its pattern so schedule rules can pick it up:
  matmul      C[b, i, j] = sum_k A[b, i, k] * B[.., k, j]   (projections, scores, weighted sums)
  epilogue    elementwise on a matmul result (bias, scale, mask): folded into its write-back
  softmax     the four blocks of a row softmax (max, exp, sum, normalise)
  elementwise anything else injective (transposes, concat)
"""
from __future__ import annotations

import tvm
from tvm import te

import numpy as np

from mhagen.ir import expr as ex
from mhagen.ir import rope
from mhagen.program import Buffer, Kernel, Program, Stage
from mhagen.workloads import ElementwiseWorkload, MatmulWorkload, RowsWorkload



def call_scalars(cross=False):
    """The call's batch and seq (cross-attention: and kv_seq) as TIR vars: the scalar
    parameters every kernel of a symbolic-length build takes last (mhagen.program.SCALARS,
    CROSS_SCALARS)."""
    names = ("batch", "seq", "kv_seq") if cross else ("batch", "seq")
    return tuple(tvm.tirx.Var(n, "int32") for n in names)


LOG2E = 1.4426950408889634   # templates compute softmax in base 2: exp(x) = 2^(x log2 e)
LN2 = 0.6931471805599453


def _dtype(x) -> str:
    # this TVM's PrimExprs name their dtype `ty`; a TensorSlice (t[i, j]) has its tensor's
    return str(x.ty) if hasattr(x, "ty") else str(x.dtype)


def cast(x, dtype: str):
    """x as dtype (no cast when it is one already)."""
    return x if _dtype(x) == dtype else x.astype(dtype)


def _f32(x):
    return cast(x, "float32")


def _numeric(op):
    """A binary TIR op on int32 or float32 values; mixed operands compute in float32."""
    def apply(a, b):
        if _dtype(a) != _dtype(b):
            a, b = _f32(a), _f32(b)
        return op(a, b)
    return apply


def _table(values, index):
    """values[clamp(index)] as a chain of selects (tables are small: one value per head or
    distance bucket); LLVM hoists it out of loops where the index is loop-invariant."""
    out = tvm.tirx.const(values[-1], "float32")
    for i in range(len(values) - 2, -1, -1):
        out = tvm.tirx.Select(index <= i, tvm.tirx.const(values[i], "float32"), out)
    return out


_TIR_OPS = {
    "const": lambda v: tvm.tirx.const(v, "int32" if isinstance(v, int) else "float32"),
    "+": _numeric(lambda a, b: a + b), "-": _numeric(lambda a, b: a - b),
    "*": _numeric(lambda a, b: a * b), "/": lambda a, b: _f32(a) / _f32(b),
    "<": _numeric(lambda a, b: a < b), "<=": _numeric(lambda a, b: a <= b),
    ">": _numeric(lambda a, b: a > b), ">=": _numeric(lambda a, b: a >= b),
    "==": _numeric(lambda a, b: a == b), "!=": _numeric(lambda a, b: a != b),
    "&": tvm.tirx.all, "|": tvm.tirx.any,
    "tanh": lambda a: tvm.tirx.tanh(_f32(a)), "exp": lambda a: tvm.tirx.exp(_f32(a)),
    "where": lambda c, a, b: tvm.tirx.Select(c, _f32(a), _f32(b)),
    "minimum": lambda a, b: tvm.tirx.min(_f32(a), _f32(b)),
    "maximum": lambda a, b: tvm.tirx.max(_f32(a), _f32(b)),
    "table": _table,
}


def mask_to_tir(mask, batch, head, q_idx, kv_idx, q_len: int, kv_len: int):
    """A mask expression as a TIR boolean of loop variables (ints become int32 constants);
    used by the unfused mask stage and by attention templates."""
    def value(v):
        return tvm.tirx.const(v, "int32") if isinstance(v, int) else v
    env = {"batch": value(batch), "head": value(head), "q_idx": value(q_idx),
           "kv_idx": value(kv_idx), "q_len": value(q_len), "kv_len": value(kv_len)}
    return ex.evaluate(mask, env, _TIR_OPS)


def score_to_tir(mod, score, batch, head, q_idx, kv_idx, q_len: int, kv_len: int,
                 math: dict | None = None, tables: dict | None = None):
    """A score modifier as a float32 TIR expression of a score and loop variables. `math`
    replaces the one-argument functions ("tanh", "exp") by the caller's TIR versions (a CPU
    template's vectorisable ones; TVM's own call scalar libm on CPUs). `tables`: the large
    tables' loads (values tuple -> index -> a load from its constant buffer, see
    expr.large_tables), read at the clamped index; smaller tables become selects."""
    def value(v):
        return tvm.tirx.const(v, "int32") if isinstance(v, int) else v
    env = {"batch": value(batch), "head": value(head), "q_idx": value(q_idx),
           "kv_idx": value(kv_idx), "q_len": value(q_len), "kv_len": value(kv_len),
           "score": score}
    ops = _TIR_OPS if not math else dict(
        _TIR_OPS, **{name: (lambda f: lambda a: f(_f32(a)))(f) for name, f in math.items()})
    if tables:
        def table(values, index):
            if values not in tables:
                return _table(values, index)
            return tables[values](tvm.tirx.max(tvm.tirx.min(index, len(values) - 1), 0))
        ops = dict(ops, table=table)
    return _f32(ex.evaluate(mod, env, ops))


def score_table_buffer(i: int, values) -> Buffer:
    """The constant param holding large table i of a score modifier (expr.large_tables)."""
    return Buffer(f"score_table{i}", (len(values),), "param", pack={"kind": "constant"},
                  value=np.asarray(values, np.float32),
                  doc="a score modifier's table (e.g. relative_bias by head and distance)")


def score_table_buffers(mod) -> list:
    """(values, constant param) for each large table of a score modifier, in
    expr.large_tables' order: the fused kernels' params, and the names and shapes their
    templates declare (schedules/attention_common.ScoreRules)."""
    return [(v, score_table_buffer(i, v)) for i, v in enumerate(ex.large_tables(mod))]


def lower_unfused(graph, batch: int, seq_len: int, kv_seq_len: int | None = None) -> Program:
    """Every node as TE stages of one kernel, `main` (any graph verify accepts)."""
    shapes = graph.shapes(**graph.dims(batch, seq_len, kv_seq_len))
    storage = graph.dtype      # x, the weights and out (mhagen/dtypes.py); compute: float32
    specs = graph.weight_specs()
    weights = {s.name: te.placeholder(tuple(s.shape), storage, name=s.name) for s in specs}
    ctx = _Ctx(graph, shapes, weights, "float32")
    ctx.storage, ctx.placeholders = storage, {}
    for n in graph.nodes:
        ctx.vals[n.name] = _LOWER[n.kind](ctx, n)
    out = ctx.vals[graph.output]
    if storage != "float32":   # rounded once, where it is stored
        out = _epilogue(ctx, graph.nodes[-1], "out_" + storage,
                        lambda *i: cast(out[i], storage),
                        tuple(int(v) for v in out.shape))
        ctx.note(f"out = {graph.output} rounded to {storage}")
    lengths = [graph.lengths_input] if graph.lengths_input is not None else []
    inputs = [ctx.placeholders.get(n.name, ctx.vals[n.name]) for n in graph.inputs + lengths]
    tables = list(ctx.tables.values()) + list(ctx.score_tables.values())
    args = inputs + [weights[s.name] for s in specs] + [t for t, _ in tables] + [out]
    func = te.create_prim_func(args)
    buffers = [Buffer(n.name, _shape(ctx, n), "input", storage) for n in graph.inputs]
    buffers += [Buffer(n.name, _shape(ctx, n), "input", "int32",
                       doc="key lengths per batch row, given at call time") for n in lengths]
    buffers += [Buffer(s.name, tuple(s.shape), "param", storage,
                       pack={"kind": "weight", "weight": s.name})
                for s in specs]
    buffers += [b for _, b in tables]
    buffers.append(Buffer("out", tuple(int(v) for v in out.shape), "output", storage))
    kernel = Kernel("main", [b.name for b in buffers], func, ctx.stages)
    return Program({b.name: b for b in buffers}, [kernel], "\n".join(ctx.text))


class _Ctx:
    def __init__(self, graph, shapes, weights, dtype):
        self.graph, self.shapes, self.weights, self.dtype = graph, shapes, weights, dtype
        self.vals, self.stages, self.text = {}, [], []
        self.transposed = {}
        self.tables = {}   # (seq, rotary_dim, base) -> (placeholder, constant param Buffer)
        self.score_tables = {}  # a large score-modifier table's values -> (placeholder, Buffer)

    def rope_table(self, seq, rotary_dim, base):
        """The [2, seq, rotary_dim / 2] cos/sin table (a constant param, float64 math)."""
        key = (seq, rotary_dim, base)
        if key not in self.tables:
            name = f"rope{len(self.tables)}"
            value = rope_table(seq, rotary_dim, base)
            self.tables[key] = (te.placeholder(value.shape, "float32", name=name),
                                Buffer(name, value.shape, "param", pack={"kind": "constant"},
                                       value=value, doc="RoPE cos [0] and sin [1] by position"))
        return self.tables[key][0]

    def score_table(self, values):
        """The placeholder of a large score-modifier table (a constant param)."""
        if values not in self.score_tables:
            b = score_table_buffer(len(self.score_tables), values)
            self.score_tables[values] = (te.placeholder(b.shape, "float32", name=b.name), b)
        return self.score_tables[values][0]

    def stage(self, name, pattern, node, blocks, workload=None):
        """A stage of the kernel; workload: what its rule reads (mhagen.workloads)."""
        self.stages.append(Stage(name, pattern, node, tuple(blocks),
                                 workload or ElementwiseWorkload()))

    def note(self, line):
        self.text.append(line)


def _shape(ctx, n):
    return tuple(int(d) for d in ctx.shapes[n.name])


def _matmul(ctx, n, name, a, b_at, depth, shape):
    """C[b, i, j] = sum_k a[b, i, k] * b_at(b, k, j), as a matmul stage."""
    k = te.reduce_axis((0, depth), name="k")
    c = te.compute(shape, lambda bb, i, j: te.sum(a[bb, i, k] * b_at(bb, k, j), axis=k), name=name)
    ctx.stage(name, "matmul", n.name, [name],
              MatmulWorkload(batch=shape[0], rows=shape[1], cols=shape[2], depth=depth))
    return c


def _epilogue(ctx, n, name, fcompute, shape):
    t = te.compute(shape, fcompute, name=name)
    ctx.stage(name, "epilogue", n.name, [name])
    return t


def _lower_input(ctx, n):
    shape = _shape(ctx, n)
    ctx.note(f"{n.name} = placeholder{list(shape)}"
             + ("" if ctx.storage == "float32" else f" {ctx.storage}"))
    x = te.placeholder(shape, ctx.storage, name=n.name)
    if ctx.storage == "float32":
        return x
    ctx.placeholders[n.name] = x      # half precision: converted to float32 once
    ctx.note(f"{n.name}_f32 = float32({n.name})")
    return _epilogue(ctx, n, n.name + "_f32", lambda *i: _f32(x[i]), shape)


def _lower_lengths(ctx, n):
    ctx.note(f"{n.name} = placeholder{list(_shape(ctx, n))} int32  # key lengths, per call")
    return te.placeholder(_shape(ctx, n), "int32", name=n.name)


def _lower_projection(ctx, n):
    x = ctx.vals[n.inputs[0]]
    shape = _shape(ctx, n)
    w = ctx.weights[n.attrs["weight"]]
    head = n.attrs.get("head")
    depth = int(x.shape[2])
    if n.kind == "head_projection":
        def w_at(bb, k, j): return _f32(w[head, k, j])
    else:
        def w_at(bb, k, j): return _f32(w[k, j])
    bias = n.attrs.get("bias")
    mm_name = n.name + "_matmul" if bias else n.name
    c = _matmul(ctx, n, mm_name, x, w_at, depth, shape)
    wtxt = f"{n.attrs['weight']}[{head}]" if head is not None else n.attrs["weight"]
    ctx.note(f"{mm_name}[b,i,j] = sum_k {n.inputs[0]}[b,i,k] * {wtxt}[k,j]")
    if not bias:
        return c
    b = ctx.weights[bias]
    if head is not None:
        def fb(bb, i, j): return c[bb, i, j] + _f32(b[head, j])
    else:
        def fb(bb, i, j): return c[bb, i, j] + _f32(b[j])
    ctx.note(f"{n.name}[b,i,j] = {mm_name}[b,i,j] + {bias}{f'[{head}]' if head is not None else ''}[j]")
    return _epilogue(ctx, n, n.name, fb, shape)


def rope_table(seq, rotary_dim, base) -> np.ndarray:
    """float32 [2, seq, rotary_dim / 2]: cos and sin of RoPE's angles (mhagen/ir/rope.py)."""
    return np.ascontiguousarray(np.stack(rope.tables(seq, rotary_dim, base)), np.float32)


def _lower_rotary(ctx, n):
    x = ctx.vals[n.inputs[0]]
    shape = _shape(ctx, n)
    rd, half = n.attrs["rotary_dim"], n.attrs["rotary_dim"] // 2
    cs = ctx.rope_table(shape[1], rd, n.attrs["base"])

    def f(bb, t, j):
        lo = x[bb, t, j] * cs[0, t, j] - x[bb, t, j + half] * cs[1, t, j]
        hi = x[bb, t, j] * cs[0, t, j - half] + x[bb, t, j - half] * cs[1, t, j - half]
        return tvm.tirx.Select(j < half, lo, tvm.tirx.Select(j < rd, hi, x[bb, t, j]))

    ctx.note(f"{n.name} = rope({n.inputs[0]}, base={n.attrs['base']:g}, rotary_dim={rd})")
    y = te.compute(shape, f, name=n.name)
    # elementwise, not an epilogue: it reads a neighbour column, so it cannot fold into the
    # projection's register-tile write-back; scalar columns, as the concat's (a Select)
    ctx.stage(n.name, "elementwise", n.name, [n.name], ElementwiseWorkload(scalar=True))
    return y


def _lower_scores(ctx, n):
    q, k = (ctx.vals[i] for i in n.inputs)
    key = n.inputs[1]
    if key not in ctx.transposed:  # K^T once per K head, so the matmul reads rows of K^T
        bsz, t, d = (int(s) for s in k.shape)
        kt = te.compute((bsz, d, t), lambda bb, dd, tt: k[bb, tt, dd], name=key + "_t")
        ctx.stage(key + "_t", "elementwise", n.name, [key + "_t"])
        ctx.note(f"{key}_t[b,d,t] = {key}[b,t,d]")
        ctx.transposed[key] = kt
    kt = ctx.transposed[key]
    ctx.note(f"{n.name}[b,i,j] = sum_k {n.inputs[0]}[b,i,k] * {key}_t[b,k,j]")
    return _matmul(ctx, n, n.name, q, lambda bb, kk, j: kt[bb, kk, j], int(q.shape[2]),
                   _shape(ctx, n))


def _lower_scale(ctx, n):
    s = ctx.vals[n.inputs[0]]
    f = tvm.tirx.const(n.attrs["factor"], ctx.dtype)
    ctx.note(f"{n.name} = {n.inputs[0]} * {n.attrs['factor']:.6g}")
    return _epilogue(ctx, n, n.name, lambda bb, i, j: s[bb, i, j] * f, _shape(ctx, n))


def _lower_mask(ctx, n):
    s = ctx.vals[n.inputs[0]]
    shape = _shape(ctx, n)
    neg_inf = tvm.tirx.const(float("-inf"), ctx.dtype)

    lens = ctx.vals[n.inputs[1]] if len(n.inputs) > 1 else None

    def f(bb, i, j):
        kv_len = shape[2] if lens is None else lens[bb].asobject()
        visible = mask_to_tir(n.attrs["mask"], bb, n.attrs["head"], i, j, shape[1], kv_len)
        return tvm.tirx.Select(visible, s[bb, i, j], neg_inf)

    ctx.note(f"{n.name} = where({n.attrs['mask']!r}, {n.inputs[0]}, -inf)")
    return _epilogue(ctx, n, n.name, f, shape)


def _lower_score_mod(ctx, n):
    s = ctx.vals[n.inputs[0]]
    shape = _shape(ctx, n)

    tables = {v: ctx.score_table(v) for v in ex.large_tables(n.attrs["expr"])}   # TE tensors

    def f(bb, i, j):
        return score_to_tir(n.attrs["expr"], s[bb, i, j].asobject(), bb, n.attrs["head"], i, j,
                            shape[1], shape[2], tables=tables)

    ctx.note(f"{n.name} = {n.attrs['expr']!r} of {n.inputs[0]} (head {n.attrs['head']})")
    return _epilogue(ctx, n, n.name, f, shape)


def _lower_softmax(ctx, n):
    """Row softmax with the max subtracted; a fully masked row (max = -inf) gives zeros."""
    s = ctx.vals[n.inputs[0]]
    bsz, rows, cols = _shape(ctx, n)
    neg_inf = tvm.tirx.const(float("-inf"), ctx.dtype)
    zero = tvm.tirx.const(0.0, ctx.dtype)
    k1 = te.reduce_axis((0, cols), name="k")
    mx = te.compute((bsz, rows), lambda bb, i: te.max(s[bb, i, k1], axis=k1), name=n.name + "_max")
    safe = te.compute((bsz, rows), lambda bb, i: tvm.tirx.Select(mx[bb, i] == neg_inf, zero,
                                                                 mx[bb, i]), name=n.name + "_safe")
    e = te.compute((bsz, rows, cols), lambda bb, i, j: te.exp(s[bb, i, j] - safe[bb, i]),
                   name=n.name + "_exp")
    k2 = te.reduce_axis((0, cols), name="k")
    total = te.compute((bsz, rows), lambda bb, i: te.sum(e[bb, i, k2], axis=k2),
                       name=n.name + "_sum")
    inv = te.compute((bsz, rows), lambda bb, i: tvm.tirx.Select(
        total[bb, i] > zero, tvm.tirx.const(1.0, ctx.dtype) / total[bb, i], zero),
        name=n.name + "_inv")
    p = te.compute((bsz, rows, cols), lambda bb, i, j: e[bb, i, j] * inv[bb, i], name=n.name)
    ctx.stage(n.name, "softmax", n.name,
              [mx.op.name, safe.op.name, e.op.name, total.op.name, inv.op.name, n.name],
              RowsWorkload(batch=bsz, rows=rows, cols=cols))
    ctx.note(f"{n.name} = softmax_rows({n.inputs[0]})  # max-subtracted; all -inf row -> 0")
    return p


def _lower_weighted_sum(ctx, n):
    p, v = (ctx.vals[i] for i in n.inputs)
    ctx.note(f"{n.name}[b,i,j] = sum_k {n.inputs[0]}[b,i,k] * {n.inputs[1]}[b,k,j]")
    return _matmul(ctx, n, n.name, p, lambda bb, k, j: v[bb, k, j], int(p.shape[2]),
                   _shape(ctx, n))


def _lower_concat(ctx, n):
    parts = [ctx.vals[i] for i in n.inputs]
    offsets, off = [], 0
    for t in parts:
        offsets.append(off)
        off += int(t.shape[2])

    def f(bb, i, c):
        out = parts[-1][bb, i, c - offsets[-1]]
        for t, o in zip(reversed(parts[:-1]), reversed(offsets[:-1])):
            out = tvm.tirx.Select(c < o + int(t.shape[2]), t[bb, i, c - o], out)
        return out

    c = te.compute(_shape(ctx, n), f, name=n.name)
    # scalar columns (see ElementwiseRule): vectorised, a Select between two heads' buffers
    # loads both sides, past a small buffer's end, and gave wrong numbers at seq_len 1
    ctx.stage(n.name, "elementwise", n.name, [n.name], ElementwiseWorkload(scalar=True))
    ctx.note(f"{n.name} = concat({', '.join(n.inputs)}, axis=-1)")
    return c


_LOWER = {
    "input": _lower_input,
    "lengths": _lower_lengths,
    "head_projection": _lower_projection,
    "output_projection": _lower_projection,
    "rotary": _lower_rotary,
    "scores": _lower_scores,
    "scale": _lower_scale,
    "mask": _lower_mask,
    "score_mod": _lower_score_mod,
    "softmax": _lower_softmax,
    "weighted_sum": _lower_weighted_sum,
    "concat_heads": _lower_concat,
}
