"""A causal grouped-K/V layer in float32, float16 and bfloat16 storage: what each costs in
memory, how far each is from the float64 reference, and how a half-precision module computes.

The half-precision modules keep their weights, input and output in 16 bits and compute in
float32 (mhagen/dtypes.py). Their reference takes the same rounded input and weights; the
bound each must meet is FlashAttention's: twice the error of a reference that rounds every
value to the dtype (`layer.reference(..., rounded_to=dtype)`). Exits 1 on a mismatch.

    python examples/half_precision.py
"""
import sys

import ml_dtypes
import numpy as np

import mhagen
from mhagen.tolerances import max_error, tolerance, within_half_reference

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def main() -> int:
    failed = False
    x32 = np.random.default_rng(0).standard_normal((1, 97, 256)).astype(np.float32)
    w32 = mhagen.mha(256, 8, kv_heads=2, causal=True).init_weights(0)
    for name, dtype in DTYPES.items():
        layer = mhagen.mha(256, 8, kv_heads=2, causal=True, dtype=name)
        w = {k: v.astype(dtype) for k, v in w32.items()}
        m = mhagen.build(layer, "x86", batch=1, seq_len=97, weights=w)
        x = x32.astype(dtype)
        y = m(x)
        expected = layer.reference(x, w)
        err, tol = max_error(y, expected), tolerance(expected, name)
        ok = err <= tol
        line = f"{name:>9}: weights {sum(a.nbytes for a in w.values()) / 1024:6.1f} KiB, " \
               f"output {y.dtype}, max error {err:.2e} (table {tol:.1e})"
        if name != "float32":
            err, bound = within_half_reference(y, expected,
                                               layer.reference(x, w, rounded_to=name))
            ok = ok and err <= bound
            line += f", half-precision reference bound {bound:.1e}"
        print(line + ("" if ok else "  MISMATCH"))
        print(f"{'':>11}{m.precision or 'float32 throughout'}")
        failed |= not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
