"""Import stage 3a: read a layer's weights exactly from the model's initializers.

The projection weight of each Q/K/V path is the constant operand of its MatMul/Gemm; which
of its columns a head's Q/K/V element comes from is found by tracing index tensors through
the ops between the projection and the attention (Reshape, Transpose, Split, Slice, Gather,
Expand...) with onnx's reference evaluator: the layer input's tokens and columns are
numbered, the numbers travel through the layout ops, and arithmetic by constants is
skipped. The bias is traced the same way, with Add/Sub kept (0 + b is b, bit for bit). Heads
are then picked out of the initializer by those column numbers, so the weights equal the
initializer values bitwise. The output projection is traced forward from the attention
outputs to its MatMul/Gemm and on to the layer output.

Anything the tracing cannot follow raises NotReadable with the reason; the importer then
falls back to the least-squares fit (fit.py).
"""
from __future__ import annotations

import numpy as np

from mhagen.onnx._common import OnnxError, node_attrs
from mhagen.onnx.probe import run_nodes
from mhagen.onnx.spec import Recovered, split_heads, split_output

ARITHMETIC = {"Add", "Sub", "Mul", "Div", "Neg"}
SCALING = {"Mul", "Div", "Neg"}


class NotReadable(Exception):
    """The weights cannot be read exactly from initializers; the message says why."""


def read_block(m, blk, specs, vals, batch) -> Recovered:
    """Weights of layer `blk` read from the initializers (probe values `vals` give shapes
    and the values of shape tensors)."""
    x_code = token_code(vals[blk.x].shape, blk.layout)
    heads = {"q": [], "k": [], "v": []}
    for c in blk.cores:
        for role, found in _read_core(m, blk, c, vals, x_code, batch).items():
            heads[role] += found
    w_o, b_o = _read_output(m, blk, specs, vals, batch)
    return Recovered(heads["q"], heads["k"], heads["v"], w_o, b_o, "initializers")


def token_code(shape, layout):
    """int64 array of `shape` ([B, S, D], or [S, B, D] seq-first): token * D + column, with
    token = b * S + s."""
    if len(shape) != 3:
        raise NotReadable(f"the layer input is {len(shape)}D")
    b, s, d = (shape[1], shape[0], shape[2]) if layout == "SBD" else shape
    tok = np.arange(b * s, dtype=np.int64).reshape(b, s)
    tok = tok.T if layout == "SBD" else tok
    return tok[:, :, None] * d + np.arange(d, dtype=np.int64)


# -- Q, K, V -------------------------------------------------------------------------------
def _read_core(m, blk, c, vals, x_code, batch):
    """{role: [(W [D, d], b [d]) per query head]} of core c."""
    traced = {r: _trace_projection(m, blk, c.paths[r], vals, x_code) for r in "qkv"}
    codes = [traced[r][0] for r in "qkv"]
    biases = [traced[r][1] for r in "qkv"]
    qkv_bias = _constant(m, c.qkv_bias, vals) if c.qkv_bias else None
    try:
        codes = split_heads(c, *codes, batch)[:3]
        biases = split_heads(c, *biases, batch, qkv_bias)[:3]
    except (OnnxError, ValueError) as err:
        raise NotReadable(f"{c.label}: the traced Q/K/V do not split into heads ({err})") from None
    width = {r: traced[r][2].shape[1] for r in "qkv"}
    return {r: _pick_heads(c, r, code, bias, traced[r][2], width[r])
            for r, code, bias in zip("qkv", codes, biases)}


def _pick_heads(c, role, code, bias, weight, width):
    """Per head (columns of `weight`, bias) from traced codes [B, H, S, d] = token * F + col."""
    tok, col = np.divmod(code, width)
    b, _, s, _ = code.shape
    expect = (np.arange(b)[:, None] * s + np.arange(s)[None, :])[:, None, :, None]
    if not np.array_equal(tok, np.broadcast_to(expect, tok.shape)):
        raise NotReadable(f"{c.label}: {role.upper()} mixes tokens between the projection and "
                          "the attention")
    if not (np.all(col == col[:1, :, :1]) and np.all(bias == bias[:1, :, :1])):
        raise NotReadable(f"{c.label}: the columns of {role.upper()} differ between tokens")
    cols, first_bias = col[0, :, 0, :], bias[0, :, 0, :]
    return [(weight[:, cols[h]], first_bias[h]) for h in range(cols.shape[0])]


def _trace_projection(m, blk, path, vals, x_code):
    """(code, bias, W [D, F]) at the core's input: code = token * F + column of W."""
    if path.proj is None:
        raise NotReadable(f"no MatMul/Gemm projects {path.role}")
    a_code = _trace_input(m, blk.x, path.proj.input[0], vals, x_code)
    weight, bias0 = weight_of(m, path.proj, vals)
    p_code, p_bias = _projected(a_code, weight, bias0, m.label(path.proj))
    _check_arithmetic(m, path, vals)
    p = path.proj.output[0]
    code = trace(m, path.nodes, {p: p_code}, vals, path.target)
    bias = trace(m, path.nodes, {p: p_bias}, vals, path.target, keep={"Add", "Sub", "Cast"})
    return code, bias, weight


def _projected(a_code, weight, bias0, label):
    """Code and bias of A @ W (+ C) from the code of A (token * D + column)."""
    d, f = weight.shape
    if a_code.shape[-1] != d:
        raise NotReadable(f"{label}: input {a_code.shape} and weight {weight.shape} do not "
                          "match")
    shape = a_code.shape[:-1] + (f,)
    code = (a_code[..., :1] // d) * f + np.arange(f, dtype=np.int64)
    bias = np.zeros(shape, np.float32)
    return code, bias if bias0 is None else bias + bias0


def _trace_input(m, x, a, vals, x_code):
    """The code of the projection's input `a` (token * D + column), traced from x."""
    d = x_code.shape[-1]
    code = x_code if a == x else trace(m, m.nodes_between({x}, a), {x: x_code}, vals, a)
    if code.shape[-1] != d or not np.array_equal(code % d, np.broadcast_to(
            np.arange(d), code.shape)) or np.any(code // d != code[..., :1] // d):
        raise NotReadable(f"the projection input {a!r} is not the layer input {x!r} with its "
                          "feature axis last")
    return code


def _check_arithmetic(m, path, vals):
    """Only scalar factors after every bias (the path's recorded factors) and biases."""
    factors = {t for t, _ in path.factors if t in vals and np.size(vals[t]) == 1}
    scaled = False
    for n in path.nodes:
        if n.op_type == "Neg" or (n.op_type in SCALING and not set(n.input) & factors):
            raise NotReadable(f"{m.label(n)} negates the projection, or scales it by a "
                              "non-scalar or before its bias")
        if n.op_type in ("Add", "Sub") and scaled:
            raise NotReadable(f"{m.label(n)} adds a bias after a constant factor")
        if n.op_type == "Sub" and n.input[0] not in m.dep:
            raise NotReadable(f"{m.label(n)} subtracts the projection from a constant")
        scaled = scaled or n.op_type in SCALING


def weight_of(m, node, vals):
    """(W [in, out], bias or None) of a MatMul/Gemm by a constant; NotReadable otherwise."""
    w = _constant(m, node.input[1], vals)
    if node.op_type == "Gemm":
        a = node_attrs(node)
        if a.get("alpha", 1.0) != 1.0 or a.get("beta", 1.0) != 1.0 or a.get("transA", 0):
            raise NotReadable(f"{m.label(node)}: alpha/beta other than 1 or transA")
        w = w.T if a.get("transB", 0) else w
        c = node.input[2] if len(node.input) > 2 and node.input[2] else None
        bias = _constant(m, c, vals) if c else None
    else:
        bias = None
    if w.ndim != 2:
        raise NotReadable(f"{m.label(node)}: the weight is {w.ndim}D, not a matrix")
    return w, bias


def _constant(m, name, vals):
    if name in m.dep or name not in vals:
        raise NotReadable(f"{name!r} is not a constant")
    return np.asarray(vals[name])


# -- tracing -------------------------------------------------------------------------------
def trace(m, nodes, feeds, vals, target, keep=frozenset()):
    """The value of `target` when `nodes` run on `feeds`, other inputs from `vals`, with
    arithmetic and Cast nodes not in `keep` passing their traced input through."""
    live, run = set(feeds), []
    for n in nodes:
        ins = [i for i in n.input if i in live]
        if not ins:
            raise NotReadable(f"{m.label(n)} does not read the traced tensor")
        if (n.op_type in ARITHMETIC or n.op_type == "Cast") and n.op_type not in keep:
            if len(ins) != 1:
                raise NotReadable(f"{m.label(n)} combines two traced tensors")
            n = _identity(n.output[0], ins[0])
        run.append(n)
        live.update(o for o in n.output if o)
    if target in feeds:
        return feeds[target]
    try:
        (value,) = run_nodes(m, run, {**vals, **feeds}, [target])
    except NotReadable:
        raise
    except Exception as err:  # the reference evaluator raises many types
        raise NotReadable(f"tracing the layout ops failed ({type(err).__name__}: "
                          f"{str(err)[:120]})") from None
    return np.asarray(value)


def _identity(out, inp):
    from onnx import helper
    return helper.make_node("Identity", [inp], [out])


# -- the output projection -----------------------------------------------------------------
def _read_output(m, blk, specs, vals, batch):
    """(w_o [H * d, D_out] in mhagen's head order, b_o [D_out])."""
    projs = {id(c.out.proj): c.out.proj for c in blk.cores}
    if len(projs) != 1 or None in projs.values():
        raise NotReadable("the heads do not meet in one output projection")
    proj = next(iter(projs.values()))
    rows = sum(s.n_heads * s.head_dim for s in specs)
    feeds = _output_codes(blk, specs, vals, batch, rows)
    a = proj.input[0]
    a_code = feeds[a] if a in feeds else trace(m, m.nodes_between(set(feeds), a), feeds,
                                               vals, a)
    order = _head_rows(a_code, rows)
    weight, bias0 = weight_of(m, proj, vals)
    if weight.shape[0] != rows:
        raise NotReadable(f"{m.label(proj)}: weight {weight.shape} for {rows} head columns")
    w_o = np.empty_like(weight)
    w_o[order] = weight
    return w_o, _output_bias(m, blk, proj, a_code, weight, bias0, vals, rows)


def _output_codes(blk, specs, vals, batch, rows):
    """{core output: int64 codes token * rows + mhagen row (head * d + j)} in its layout."""
    feeds, first = {}, 0
    for c, spec in zip(blk.cores, specs):
        shape = vals[c.o].shape
        where = split_output(c, np.arange(int(np.prod(shape))).reshape(shape), batch)
        b, h, s, d = where.shape
        tok = np.arange(b)[:, None, None, None] * s + np.arange(s)[None, None, :, None]
        row = first + np.arange(h)[None, :, None, None] * d + np.arange(d)
        code = np.empty(int(np.prod(shape)), np.int64)
        code[where.reshape(-1)] = np.broadcast_to(tok * rows + row, where.shape).reshape(-1)
        feeds[c.o] = code.reshape(shape)
        first += h * d
    return feeds


def _head_rows(a_code, rows):
    """Which mhagen row each column of the output projection's input is."""
    if a_code.shape[-1] != rows:
        raise NotReadable(f"the output projection reads {a_code.shape[-1]} columns, the heads "
                          f"give {rows}")
    tok, row = np.divmod(a_code.reshape(-1, rows), rows)
    if not (np.all(row == row[:1]) and np.all(tok == tok[:, :1])):
        raise NotReadable("the heads' outputs mix tokens before the output projection")
    if not np.array_equal(np.sort(row[0]), np.arange(rows)):
        raise NotReadable("the output projection does not read every head column once")
    return row[0]


def _output_bias(m, blk, proj, a_code, weight, bias0, vals, rows):
    """b_o, traced from the output projection to the layer output (zeros if none)."""
    tok_code = a_code[..., :1] // rows * rows   # back to token * D_in + column form
    p_code, p_bias = _projected(tok_code + np.arange(rows), weight, bias0, m.label(proj))
    nodes = m.nodes_between({proj.output[0]}, blk.y)
    if any(n.op_type in SCALING for n in nodes):
        raise NotReadable("the output projection is scaled")
    p = proj.output[0]
    code = trace(m, nodes, {p: p_code}, vals, blk.y)
    bias = trace(m, nodes, {p: p_bias}, vals, blk.y, keep={"Add", "Sub", "Cast"})
    if not np.array_equal(code, token_code(vals[blk.y].shape, blk.layout)):
        raise NotReadable(f"the layer output {blk.y!r} is not the output projection's tokens "
                          "in order")
    flat = bias.reshape(-1, bias.shape[-1])
    if not np.all(flat == flat[:1]):
        raise NotReadable("the output bias differs between tokens")
    return flat[0]
