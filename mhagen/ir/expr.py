"""Mask expressions: small functions of (batch, head, q_idx, kv_idx), in the style of
PyTorch FlexAttention's mask_mod, kept as data so that every backend can evaluate them.

    >>> from mhagen.ir.expr import q_idx, kv_idx
    >>> causal = kv_idx <= q_idx
    >>> window = causal & (q_idx - kv_idx < 4)

An expression is evaluated by `evaluate(expr, env, ops)`: the numpy reference passes numpy
index grids and numpy ops, the TE lowering passes TVM loop variables and TIR ops. Masks are
boolean expressions (True = the key is visible); comparisons return boolean expressions.
Equality is `a.eq(b)` (Python's `==` stays structural).

Shape legend: batch and head are scalars per score, q_idx in [0, q_len), kv_idx in [0, kv_len).
"""
from __future__ import annotations

import numbers

VARIABLES = ("batch", "head", "q_idx", "kv_idx", "q_len", "kv_len")
BINARY_OPS = ("+", "-", "*", "<", "<=", ">", ">=", "==", "!=", "&", "|")
BOOLEAN_OPS = ("<", "<=", ">", ">=", "==", "!=", "&", "|")


class Expr:
    """Base class of mask expressions; build them from the variables below and operators."""

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
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"mask constants must be integers, got {value!r}")
        self.value = int(value)

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
    raise ValueError(f"bad mask expression {data!r}: expected var, const or op with two args")


def evaluate(expr: Expr, env: dict, ops: dict):
    """Evaluate `expr` with variables from `env` and operators from `ops` (op -> callable)."""
    if isinstance(expr, Var):
        return env[expr.name]
    if isinstance(expr, Const):
        return ops["const"](expr.value)
    return ops[expr.op](evaluate(expr.lhs, env, ops), evaluate(expr.rhs, env, ops))


def variables(expr: Expr) -> set:
    if isinstance(expr, Var):
        return {expr.name}
    if isinstance(expr, Const):
        return set()
    return variables(expr.lhs) | variables(expr.rhs)


batch = Var("batch")
head = Var("head")
q_idx = Var("q_idx")
kv_idx = Var("kv_idx")
q_len = Var("q_len")
kv_len = Var("kv_len")


def causal() -> Expr:
    """Query i sees keys 0..i (top-left aligned: q_idx and kv_idx count from the same start)."""
    return kv_idx <= q_idx


def sliding_window(window: int) -> Expr:
    """Causal, and query i sees only the `window` most recent keys i-window+1..i."""
    if int(window) < 1:
        raise ValueError(f"sliding window must be >= 1, got {window}")
    return causal() & (q_idx - kv_idx < int(window))
