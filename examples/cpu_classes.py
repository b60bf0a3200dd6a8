"""One layer, every x86 CPU class: what mhagen derives for each, and whether it runs here.

For the presets x86 (this CPU), x86-avx2 and x86-avx512 this builds a causal grouped-K/V
layer at an awkward shape (seq 97), prints the target's class, its register tiles and the
tuning records it used, and checks the module against the float64 reference where this host
can run the code; where it cannot (AVX-512 code on an AVX2 host), it shows the error a call
gets instead of a crash. Exits 1 on a mismatch.

    python examples/cpu_classes.py [PRESET ...]     (default: all three)
"""
import sys

import numpy as np

import mhagen
from mhagen.records.database import describe_record
from mhagen.tolerances import tolerance

PRESETS = ("x86", "x86-avx2", "x86-avx512")


def main(presets=PRESETS) -> int:
    layer = mhagen.mha(256, 8, kv_heads=2, causal=True)
    w = layer.init_weights(0)
    x = np.random.default_rng(0).standard_normal((2, 97, 256)).astype(np.float32)
    expected = layer.reference(x, w)
    failed = False
    for preset in presets:
        m = mhagen.build(layer, preset, batch=2, seq_len=97, weights=w)
        t = m.target
        print(f"{preset}: class {t.cpu_class} (LLVM cpu {t.cpu}, {t.lanes} float lanes, "
              f"{t.vector_registers} vector registers, L2 {t.l2_kib} KiB)")
        for d in m.decisions:
            print(f"  {d['kernel']:<18} {d['source']:<8} {d['config']}")
        for r in m.tuning_records:
            print(f"  record {describe_record(r)}")
        if m.cannot_run:
            try:
                m(x)
            except mhagen.TargetError as err:
                print(f"  not run here: {err}")
            continue
        err, tol = mhagen.max_error(m(x), expected), tolerance(expected)
        ok = err <= tol
        failed |= not ok
        print(f"  max error {err:.2e} (tolerance {tol:.1e}) {'ok' if ok else 'MISMATCH'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or PRESETS))
