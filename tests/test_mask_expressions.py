"""Mask expressions (mhagen/ir/expr.py): building, structural equality, JSON, what they
evaluate to, and the errors of using them as Python booleans or with bad operands."""
import numpy as np
import pytest

import mhagen
from mhagen import GraphError
from mhagen.ir import expr as ex


def test_mask_expression_building():
    m = mhagen.causal() & (mhagen.q_idx - mhagen.kv_idx < 4)
    assert m.is_bool and repr(m) == "((kv_idx <= q_idx) & ((q_idx - kv_idx) < 4))"
    assert m == mhagen.sliding_window(4)
    assert not (mhagen.q_idx + 1).is_bool
    assert (1 + mhagen.q_idx).to_json() == {"op": "+", "args": [{"const": 1}, {"var": "q_idx"}]}
    assert mhagen.q_idx.eq(mhagen.kv_idx).is_bool and mhagen.q_idx.ne(3).is_bool
    # == stays structural (returns a bool), so masks can live in sets and dicts
    assert (mhagen.q_idx == mhagen.kv_idx) is False
    assert len({mhagen.causal(), mhagen.causal()}) == 1
    assert ex.from_json(m.to_json()) == m


def test_mask_expression_evaluates_like_its_meaning():
    from mhagen.reference import mask_grid
    grid = mask_grid(mhagen.sliding_window(3), batch=1, head=0, q_len=6, kv_len=6)[0]
    q, k = np.indices((6, 6))
    np.testing.assert_array_equal(grid, (k <= q) & (q - k < 3))


@pytest.mark.parametrize("combine", [
    lambda a, b: a and b,
    lambda a, b: a or b,
    lambda a, b: not a,
    lambda a, b: bool(a),
    lambda a, b: b if a else a,
], ids=["and", "or", "not", "bool", "if"])
def test_mask_truth_value_raises(combine):
    with pytest.raises(TypeError, match=r"no truth value.*& and \|.*\.eq\(\)"):
        combine(mhagen.causal(), mhagen.sliding_window(3))


@pytest.mark.parametrize("combine", [
    lambda: mhagen.q_idx & mhagen.kv_idx,
    lambda: mhagen.causal() & (mhagen.q_idx + 1),
    lambda: (mhagen.q_idx - mhagen.kv_idx) | mhagen.causal(),
    lambda: mhagen.causal() & 1,
    lambda: 1 | mhagen.causal(),
], ids=["vars", "bool&int-expr", "int-expr|bool", "bool&const", "const|bool"])
def test_mask_and_or_on_non_boolean_raises(combine):
    with pytest.raises(TypeError, match="combines boolean masks"):
        combine()


@pytest.mark.parametrize("make, exc, fragment", [
    (lambda: mhagen.mha(32, 2, mask=mhagen.q_idx < 1.5), GraphError,
     "mask must be a boolean expression of integers"),
    (lambda: mhagen.q_idx + True, TypeError, "expression constants must be numbers"),
    (lambda: ex.Var("i"), ValueError, "use one of batch, head, q_idx, kv_idx"),
    (lambda: ex.BinOp("//", mhagen.q_idx, mhagen.kv_idx), ValueError, "unknown operator '//'"),
    (lambda: mhagen.sliding_window(0), ValueError, "sliding window must be >= 1"),
    (lambda: ex.from_json({"op": "<", "args": [{"var": "q_idx"}]}), ValueError,
     "expected var, const, op, call or table"),
    (lambda: ex.from_json(3), ValueError, "expected an object"),
], ids=["float-const", "bool-const", "unknown-var", "unknown-op", "window-zero",
        "json-one-arg", "json-not-object"])
def test_mask_expression_errors(make, exc, fragment):
    with pytest.raises(exc, match=None) as info:
        make()
    assert fragment in str(info.value)
