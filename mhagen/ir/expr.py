"""Mask and score expressions: small functions of (batch, head, q_idx, kv_idx) and, for
score modifiers, of the score itself, in the style of PyTorch FlexAttention's mask_mod and
score_mod, kept as data so that every backend can evaluate them.

    >>> from mhagen.ir.expr import q_idx, kv_idx, score, tanh
    >>> causal = kv_idx <= q_idx
    >>> window = causal & (q_idx - kv_idx < 4)
    >>> capped = 30.0 * tanh(score / 30.0)               # a score modifier (softcap)

Masks are boolean expressions of integers (no score, no floats): the reference evaluates
them on index grids, the kernels per score and at build time per block (block tables).
Score modifiers are numeric expressions of `score` (the scaled score) and the indices, with
float constants, `/`, `tanh`, `exp`, `where`, `minimum`, `maximum` and `table(values, index)`
(a constant per-head or per-position table, e.g. ALiBi slopes).

An expression is evaluated by `evaluate(expr, env, ops)`: the numpy reference passes numpy
index grids and numpy ops, the TE lowering passes TVM loop variables and TIR ops. Masks are
boolean expressions (True = the key is visible); comparisons return boolean expressions.
Equality is `a.eq(b)` (Python's `==` stays structural).

Shape legend: batch and head are scalars per score, q_idx in [0, q_len), kv_idx in [0, kv_len).
"""
from __future__ import annotations

import math
import numbers

VARIABLES = ("batch", "head", "q_idx", "kv_idx", "q_len", "kv_len", "score")
BINARY_OPS = ("+", "-", "*", "/", "<", "<=", ">", ">=", "==", "!=", "&", "|")
BOOLEAN_OPS = ("<", "<=", ">", ">=", "==", "!=", "&", "|")
FUNCTIONS = {"tanh": 1, "exp": 1, "where": 3, "minimum": 2, "maximum": 2}   # name -> arity


class Expr:
    """Base class of expressions; build them from the variables below and operators."""

    __slots__ = ()
    is_bool = False

    def _bin(self, op, other, swap=False):
        other = as_expr(other)
        return BinOp(op, other, self) if swap else BinOp(op, self, other)

    def __add__(self, o): return self._bin("+", o)
    def __radd__(self, o): return self._bin("+", o, swap=True)
    def __sub__(self, o): return self._bin("-", o)
    def __rsub__(self, o): return self._bin("-", o, swap=True)
    def __mul__(self, o): return self._bin("*", o)
    def __rmul__(self, o): return self._bin("*", o, swap=True)
    def __truediv__(self, o): return self._bin("/", o)
    def __rtruediv__(self, o): return self._bin("/", o, swap=True)
    def __neg__(self): return Const(0) - self
    def __lt__(self, o): return self._bin("<", o)
    def __le__(self, o): return self._bin("<=", o)
    def __gt__(self, o): return self._bin(">", o)
    def __ge__(self, o): return self._bin(">=", o)
    def __and__(self, o): return self._bin("&", o)
    def __rand__(self, o): return self._bin("&", o, swap=True)
    def __or__(self, o): return self._bin("|", o)
    def __ror__(self, o): return self._bin("|", o, swap=True)

    def eq(self, o): return self._bin("==", o)
    def ne(self, o): return self._bin("!=", o)

    def __eq__(self, other):
        return isinstance(other, Expr) and self.to_json() == other.to_json()

    def __hash__(self):
        return hash(repr(self))

    def __bool__(self):
        raise TypeError("a mask expression has no truth value; combine masks with & and |, "
                        "not `and`/`or`, and compare with .eq() instead of ==")


class Var(Expr):
    __slots__ = ("name",)

    def __init__(self, name: str):
        if name not in VARIABLES:
            raise ValueError(f"unknown mask variable {name!r}; use one of {', '.join(VARIABLES)}")
        self.name = name

    def to_json(self):
        return {"var": self.name}

    def __repr__(self):
        return self.name


class Const(Expr):
    __slots__ = ("value",)

    def __init__(self, value):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"expression constants must be numbers, got {value!r}")
        if value != value:
            raise ValueError("expression constants must not be NaN (every score it touched "
                             "would be NaN); use float('-inf') in a score modifier to hide keys")
        self.value = int(value) if isinstance(value, numbers.Integral) else float(value)

    def to_json(self):
        return {"const": self.value}

    def __repr__(self):
        return str(self.value)


class BinOp(Expr):
    __slots__ = ("op", "lhs", "rhs")

    def __init__(self, op: str, lhs: Expr, rhs: Expr):
        if op not in BINARY_OPS:
            raise ValueError(f"unknown operator {op!r}; use one of {' '.join(BINARY_OPS)}")
        if op in ("&", "|") and not (lhs.is_bool and rhs.is_bool):
            raise TypeError(f"'{op}' combines boolean masks; got {lhs!r} {op} {rhs!r}")
        self.op, self.lhs, self.rhs = op, lhs, rhs

    @property
    def is_bool(self):
        return self.op in BOOLEAN_OPS

    def to_json(self):
        return {"op": self.op, "args": [self.lhs.to_json(), self.rhs.to_json()]}

    def __repr__(self):
        return f"({self.lhs!r} {self.op} {self.rhs!r})"


class Call(Expr):
    """A function of expressions: tanh, exp, where(cond, a, b), minimum, maximum."""
    __slots__ = ("fn", "args")

    def __init__(self, fn: str, *args):
        if FUNCTIONS.get(fn) != len(args):
            raise ValueError(f"unknown function {fn}/{len(args)}; expression functions: "
                             f"{', '.join(f'{k}/{v}' for k, v in FUNCTIONS.items())}")
        self.fn, self.args = fn, tuple(as_expr(a) for a in args)
        if fn == "where" and not self.args[0].is_bool:
            raise TypeError(f"where() takes a boolean condition first, got {self.args[0]!r}")

    def to_json(self):
        return {"call": self.fn, "args": [a.to_json() for a in self.args]}

    def __repr__(self):
        return f"{self.fn}({', '.join(map(repr, self.args))})"


class Table(Expr):
    """values[index]: a constant table (per head, per distance bucket) indexed by an integer
    expression; an index outside the table is clamped to its ends."""
    __slots__ = ("values", "index")

    def __init__(self, values, index):
        if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
            raise TypeError(f"a table takes a sequence of numbers, got {values!r}")
        values = tuple(values)
        bad = [v for v in values if isinstance(v, bool) or not isinstance(v, numbers.Real)
               or v != v]
        if bad:
            raise ValueError(f"table values must be numbers (not NaN), got {bad[0]!r}")
        self.values = tuple(float(v) for v in values)
        if not self.values:
            raise ValueError("a table needs at least one value")
        self.index = as_expr(index)
        if not is_integer(self.index):
            raise TypeError(f"a table index must be an integer expression, got {self.index!r}")

    def to_json(self):
        return {"table": list(self.values), "index": self.index.to_json()}

    def __repr__(self):   # short for printing: compare expressions with ==, not repr
        return f"table[{len(self.values)}][{self.index!r}]"


def as_expr(value) -> Expr:
    return value if isinstance(value, Expr) else Const(value)


def from_json(data) -> Expr:
    if not isinstance(data, dict):
        raise ValueError(f"bad mask expression {data!r}: expected an object")
    if "var" in data:
        return Var(data["var"])
    if "const" in data:
        return Const(data["const"])
    if "op" in data and isinstance(data.get("args"), list) and len(data["args"]) == 2:
        return BinOp(data["op"], from_json(data["args"][0]), from_json(data["args"][1]))
    if "call" in data and isinstance(data.get("args"), list):
        return Call(data["call"], *(from_json(a) for a in data["args"]))
    if "table" in data and isinstance(data["table"], list):
        return Table(data["table"], from_json(data.get("index")))
    raise ValueError(f"bad expression {data!r}: expected var, const, op, call or table")


def evaluate(expr: Expr, env: dict, ops: dict):
    """Evaluate `expr` with variables from `env` and operators from `ops` (op -> callable)."""
    if isinstance(expr, Var):
        return env[expr.name]
    if isinstance(expr, Const):
        return ops["const"](expr.value)
    if isinstance(expr, Call):
        return ops[expr.fn](*(evaluate(a, env, ops) for a in expr.args))
    if isinstance(expr, Table):
        return ops["table"](expr.values, evaluate(expr.index, env, ops))
    return ops[expr.op](evaluate(expr.lhs, env, ops), evaluate(expr.rhs, env, ops))


def children(expr: Expr) -> tuple:
    if isinstance(expr, BinOp):
        return (expr.lhs, expr.rhs)
    if isinstance(expr, Call):
        return expr.args
    if isinstance(expr, Table):
        return (expr.index,)
    return ()


LARGE_TABLE = 32
"""Tables with more values than this are read from a constant buffer by the kernels; smaller
ones (a value per head or bucket) become a chain of selects that LLVM hoists out of loops."""


def large_tables(expr) -> list:
    """The values of expr's large tables (tuples, first-seen order, each once): the constant
    buffers score_table0, score_table1, ... of the kernels that evaluate expr."""
    if expr is None:
        return []
    found = [expr.values] if isinstance(expr, Table) and len(expr.values) > LARGE_TABLE else []
    for c in children(expr):
        found += [v for v in large_tables(c) if v not in found]
    return found


def head_tables(expr: Expr) -> list:
    """The tables of expr indexed by the head alone (one value per head: ALiBi's slopes,
    relative_bias's far buckets): their length must be the layer's head count."""
    found = [expr] if isinstance(expr, Table) and expr.index == head else []
    for c in children(expr):
        found += head_tables(c)
    return found


def variables(expr: Expr) -> set:
    if isinstance(expr, Var):
        return {expr.name}
    return set().union(*(variables(c) for c in children(expr)))


def is_integer(expr: Expr) -> bool:
    """True when expr computes on integers only (no score, float, division, function or
    table): what a mask may be made of."""
    if isinstance(expr, Var):
        return expr.name != "score"
    if isinstance(expr, Const):
        return isinstance(expr.value, int)
    if isinstance(expr, BinOp):
        return expr.op != "/" and is_integer(expr.lhs) and is_integer(expr.rhs)
    return False


INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1


def subexpressions(expr: Expr):
    """expr and every expression inside it."""
    yield expr
    for c in children(expr):
        yield from subexpressions(c)


def int_overflow(expr: Expr, bound: int | None):
    """(subexpression, (lo, hi)) of the first integer subexpression of `expr` whose value
    can leave int32 when every index variable lies in [0, bound] (bound None: sizes not
    known, constants only), else None. The kernels compute integer expressions in int32 and
    the reference in int64: an edited index constant of -2^31 wrapped in the kernel and
    clamped in the reference (max error 0.14, silently)."""
    def span(e):
        if isinstance(e, Var):
            return None if bound is None else (0, bound)
        if isinstance(e, Const):
            return (e.value, e.value)
        if e.is_bool:
            return (0, 1)
        a, b = span(e.lhs), span(e.rhs)
        if a is None or b is None:
            return None
        if e.op == "+":
            return (a[0] + b[0], a[1] + b[1])
        if e.op == "-":
            return (a[0] - b[1], a[1] - b[0])
        products = [x * y for x in a for y in b]
        return (min(products), max(products))
    for e in subexpressions(expr):
        if is_integer(e):
            r = span(e)
            if r is not None and (r[0] < INT32_MIN or r[1] > INT32_MAX):
                return e, r
    return None


def substitute(expr: Expr, name: str, value: Expr) -> Expr:
    """expr with variable `name` replaced by `value` (composes score modifiers)."""
    if isinstance(expr, Var):
        return value if expr.name == name else expr
    if isinstance(expr, BinOp):
        return BinOp(expr.op, substitute(expr.lhs, name, value),
                     substitute(expr.rhs, name, value))
    if isinstance(expr, Call):
        return Call(expr.fn, *(substitute(a, name, value) for a in expr.args))
    if isinstance(expr, Table):
        return Table(expr.values, substitute(expr.index, name, value))
    return expr


batch = Var("batch")
head = Var("head")
q_idx = Var("q_idx")
kv_idx = Var("kv_idx")
q_len = Var("q_len")
kv_len = Var("kv_len")
score = Var("score")


def tanh(x) -> Expr:
    return Call("tanh", x)


def exp(x) -> Expr:
    return Call("exp", x)


def where(cond, a, b) -> Expr:
    return Call("where", cond, a, b)


def minimum(a, b) -> Expr:
    return Call("minimum", a, b)


def maximum(a, b) -> Expr:
    return Call("maximum", a, b)


def table(values, index) -> Expr:
    return Table(values, index)


def causal() -> Expr:
    """Query i sees keys 0..i (top-left aligned: q_idx and kv_idx count from the same start)."""
    return kv_idx <= q_idx


def _positive_int(what: str, value) -> int:
    """value as an int if it is a positive integer (not a bool); else TypeError/ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be a positive integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{what} must be >= 1, got {value!r}")
    return int(value)


def sliding_window(window: int) -> Expr:
    """Causal, and query i sees only the `window` most recent keys i-window+1..i."""
    window = _positive_int("sliding window", window)
    return causal() & (q_idx - kv_idx < window)


# -- score modifiers -------------------------------------------------------------------------
def is_score_mod(expr) -> bool:
    """A valid score modifier: a numeric (not boolean) expression."""
    return isinstance(expr, Expr) and not expr.is_bool


def combine(*mods) -> Expr:
    """Apply score modifiers in order: combine(alibi(8), softcap(30)) caps the ALiBi score."""
    out = score
    for m in mods:
        if not is_score_mod(m):
            raise TypeError(f"a score modifier is a numeric expression of score, got {m!r}")
        out = substitute(m, "score", out)
    return out


def alibi_slopes(num_heads: int) -> list:
    """ALiBi's head slopes (Press et al. 2022): 2^(-8(h+1)/H) for H a power of two; otherwise
    the slopes of the nearest smaller power of two n, then every other slope of 2n (the
    paper's appendix and its reference code)."""
    def powers(n):
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]
    num_heads = _positive_int("alibi's num_heads", num_heads)
    n = 1 << (num_heads.bit_length() - 1)
    if n == num_heads:
        return powers(n)
    return powers(n) + powers(2 * n)[0::2][:num_heads - n]


def alibi(num_heads: int) -> Expr:
    """score + slope_h * (kv_idx - q_idx): ALiBi's linear distance bias per head."""
    return score + table(alibi_slopes(num_heads), head) * (kv_idx - q_idx)


def softcap(cap: float) -> Expr:
    """cap * tanh(score / cap) (Gemma 2): scores bounded to (-cap, cap)."""
    if isinstance(cap, bool) or not isinstance(cap, numbers.Real):
        raise TypeError(f"softcap needs a positive number, got {cap!r}")
    if not (cap > 0 and math.isfinite(cap)):
        raise ValueError(f"softcap needs a positive cap (a finite number), got {cap!r}")
    cap = float(cap)
    return cap * tanh(score / cap)


def t5_bucket(distance: int, num_buckets: int, max_distance: int, bidirectional: bool) -> int:
    """T5's relative position bucket of distance = kv_idx - q_idx (Raffel et al. 2020; Hugging
    Face's T5Attention._relative_position_bucket): exact buckets for small distances,
    logarithmic ones up to max_distance, the last bucket beyond; bidirectional tables give
    keys after the query the upper half of the buckets."""
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        bucket += num_buckets if distance > 0 else 0
        n = abs(distance)
    else:
        n = -min(distance, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return bucket + n
    large = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact)
                            * (num_buckets - max_exact))
    return bucket + min(large, num_buckets - 1)


def relative_bias(table, *, max_distance: int = 128, bidirectional: bool = True) -> Expr:
    """score + table[head, bucket(kv_idx - q_idx)]: T5's learned relative position bias,
    table [num_heads, num_buckets] (T5's `relative_attention_bias` weight transposed), added
    to the scaled score; buckets as `t5_bucket`. Distances past max_distance share the last
    bucket, so the modifier is a table over the distances -max_distance..max_distance per
    head (what the kernels read; beyond them, a per-head constant)."""
    try:
        rows = [[float(v) for v in row] for row in table]
    except (TypeError, ValueError):
        rows = None
    if not rows or not rows[0] or any(len(r) != len(rows[0]) for r in rows):
        raise ValueError(f"relative_bias takes a table [num_heads, num_buckets] of numbers "
                         f"(T5's relative_attention_bias.weight transposed), got {table!r:.80}")
    heads, buckets = len(rows), len(rows[0])
    if buckets < (4 if bidirectional else 2):
        raise ValueError(f"relative_bias needs at least {4 if bidirectional else 2} buckets "
                         f"(bidirectional={bidirectional}), got {buckets}")
    max_distance = _positive_int("relative_bias's max_distance", max_distance)
    half = buckets // 2 if bidirectional else buckets
    if max_distance <= half // 2:
        raise ValueError(f"relative_bias's max_distance ({max_distance}) must exceed the "
                         f"exact buckets ({half // 2})")
    return distance_bias([[row[t5_bucket(d, buckets, max_distance, bidirectional)]
                           for d in range(-max_distance, max_distance + 1)] for row in rows],
                         max_distance)


def distance_bias(values, max_distance: int) -> Expr:
    """score + values[head][kv_idx - q_idx + max_distance]: a learned bias per head and
    distance, values [num_heads, 2 max_distance + 1] over the distances -max_distance ..
    max_distance; farther distances take the nearest end's value (as T5's buckets do)."""
    width = 2 * max_distance + 1
    if any(len(row) != width for row in values):
        raise ValueError(f"distance_bias takes {width} values per head "
                         f"(-{max_distance}..{max_distance})")
    near = Table([float(v) for row in values for v in row],
                 head * width + (kv_idx - q_idx) + max_distance)
    far_after = Table([float(row[-1]) for row in values], head)
    far_before = Table([float(row[0]) for row in values], head)
    d = kv_idx - q_idx
    return score + where(d >= max_distance, far_after,
                         where(d <= -max_distance, far_before, near))
