"""The operators of the expression language (mhagen/ir/expr.py) as numpy functions, for
`expr.evaluate(e, env, NUMPY_OPS)`: masks and score modifiers evaluated in numpy (block
tables, verify's constant checks; the kernels use TVM's operators, mhagen/lower/te.py)."""
import numpy as np

NUMPY_OPS = {
    "const": lambda v: v,
    "+": np.add, "-": np.subtract, "*": np.multiply, "/": np.true_divide,
    "<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal,
    "==": np.equal, "!=": np.not_equal, "&": np.logical_and, "|": np.logical_or,
    "tanh": np.tanh, "exp": np.exp, "where": np.where, "minimum": np.minimum,
    "maximum": np.maximum,
    "table": lambda values, i: np.asarray(values)[np.clip(i, 0, len(values) - 1)],
}
