"""The fused kernels' packed GEMM stage in TE: C = a @ W + bias with W in column panels,
wp[n // nr, k, n % nr] (or in pairs of the depth: bfloat16 dot products, AMX tiles)."""
from __future__ import annotations

from dataclasses import dataclass

from tvm import te

from mhagen.dtypes import COMPUTE
from mhagen.lower.plan import GemmPath
from mhagen.lower.te import cast
from mhagen.program import Stage
from mhagen.workloads import GemmWorkload


@dataclass(frozen=True)
class GemmShape:
    """One packed GEMM's rows and columns. rows: what the product runs over (the backend's
    gemm_rows: padded to whole register tiles or not; rows of `a` past its end are read
    clamped); out_rows: what C keeps (None: all). Symbolic-length builds (`scalars`: the
    batch and seq vars): rows are expressions of them, at most max_rows; a_exact: `a` has
    the call's exact rows (an input), not whole tiles. panel_major: C is
    [cols / nr, out_rows, nr] (column panels), else [out_rows, cols]. head_panels:
    (sections, heads, panels a head) where C's panels are Q, K and V of every head, each
    section heads x panels wide: the rule may run them head by head."""
    rows: object
    cols: int
    nr: int
    out_rows: object = None
    panel_major: bool = False
    scalars: tuple = ()
    max_rows: int | None = None
    a_exact: bool = False
    head_panels: tuple | None = None


def packed_gemm(name, node, a, wp, bias, shape: GemmShape, path: GemmPath, out_dtype=None):
    """C and the GEMM's stages. Half-precision a or W (a layer's storage dtype) are converted
    to float32 where they are loaded (the pack stage converts as it copies); products
    accumulate in float32; out_dtype: C's dtype (default float32; rounded after the bias).
    path.pack_tile: first copy `a` into panels of that many rows, k-major
    (a_p[m // t, k, m % t]), so a register tile reads one stream.
    path.pairs: the depth runs in pairs k = 2 * k2 + p (one bfloat16 dot-product instruction
    per pair): W is wp[n // nr, k2, n % nr, p] and `a` is always packed (pack_tile rows), as
    a_p[m // t, k2, m % t, p], both bfloat16 (a float32 `a`, the attention's output, is
    rounded by the pack).
    path.amx: on AMX tiles (32 rows x 32 of the depth, schedules/x86/amx.py): W as for
    pairs, `a` packed as a_t[m // 32, k // 32, m % 32, k2, p] (k % 32 = 2 * k2 + p)."""
    rows, nr = shape.rows, shape.nr
    a_row = RowReader(a, rows, shape.scalars, shape.a_exact)
    if path.amx:
        term, axes, packed = _amx_product(name, a_row, wp, rows, path)
    elif path.pairs:
        term, axes, packed = _pairs_product(name, a_row, wp, rows, path, shape.scalars)
    else:
        term, axes, packed = _float_product(name, a_row, wp, rows, path, shape.scalars)
    pack_stages = [] if packed is None else [Stage(packed.op.name, "pack", node,
                                                   (packed.op.name,))]
    mm, out = _product_and_bias(name, term, axes, bias, shape, out_dtype or COMPUTE)
    work = GemmWorkload(rows=shape.max_rows if shape.scalars else rows, cols=shape.cols,
                        depth=path.depth, panel=nr, panel_major=shape.panel_major,
                        pairs=path.pairs, amx=path.amx, head_panels=shape.head_panels or None,
                        symbolic=bool(shape.scalars))   # symbolic: row blocks for the largest
    stages = [Stage(mm.op.name, "packed_matmul", node, (mm.op.name,), work),
              Stage(name, "epilogue", node, (name,))] + pack_stages   # the GEMM rule packs
    return out, stages


class RowReader:
    """Row m of `a`, for m < extent (default: the GEMM's rows), clamped where `a` has fewer
    rows (symbolic builds: where `a` holds the call's exact rows)."""

    def __init__(self, a, rows, scalars, a_exact):
        self.a, self.rows, self.scalars, self.a_exact = a, rows, scalars, a_exact
        self.last = a.shape[0] - 1

    def __call__(self, m, extent=None):
        extent = self.rows if extent is None else extent
        if self.scalars:
            return te.min(m, self.last) if self.a_exact else m
        return m if int(self.last) + 1 >= extent else te.min(m, self.last)


def _amx_product(name, a_row, wp, rows, path):
    a, t, steps = a_row.a, path.pack_tile, path.depth // 32
    packed = te.compute((rows // t, steps, t, 16, 2),
                        lambda i, s, r, k2, p: cast(a[a_row(i * t + r), 32 * s + 2 * k2 + p],
                                                    "bfloat16"),
                        name=name + "_pack")
    kt, k2 = te.reduce_axis((0, steps), name="kt"), te.reduce_axis((0, 16), name="k2")
    kp = te.reduce_axis((0, 2), name="kp")

    def term(m, panel, j):
        return (_f32(packed[m // t, kt, m % t, k2, kp])
                * _f32(wp[panel, kt * 16 + k2, j, kp]))
    return term, [kt, k2, kp], packed


def _pairs_product(name, a_row, wp, rows, path, scalars):
    a, t, depth = a_row.a, path.pack_tile, path.depth
    if not scalars and int(rows) < t:
        t = int(rows)   # a GEMM of fewer rows than a tile runs one shorter tile (a decode step)
    packed = te.compute((rows // t, depth // 2, t, 2),
                        lambda i, k2, r, p: cast(a[a_row(i * t + r), 2 * k2 + p], "bfloat16"),
                        name=name + "_pack")
    k2, kp = te.reduce_axis((0, depth // 2), name="k2"), te.reduce_axis((0, 2), name="kp")

    def term(m, panel, j):
        return _f32(packed[m // t, k2, m % t, kp]) * _f32(wp[panel, k2, j, kp])
    return term, [k2, kp], packed


def _float_product(name, a_row, wp, rows, path, scalars):
    a, t, depth = a_row.a, path.pack_tile, path.depth
    k = te.reduce_axis((0, depth), name="k")
    read = lambda m, kk: _f32(a[a_row(m), kk])   # noqa: E731
    packed = None
    if t:   # whole tiles (a partial last one copies the last row again)
        tiles = rows // t if scalars else -(-int(rows) // t)
        packed = te.compute((tiles, depth, t),
                            lambda i, kk, r: _f32(a[a_row(i * t + r, tiles * t), kk]),
                            name=name + "_pack")
        read = lambda m, kk: packed[m // t, kk, m % t]   # noqa: E731

    def term(m, panel, j):
        return read(m, k) * _f32(wp[panel, k, j])
    return term, [k], packed


def _product_and_bias(name, term, axes, bias, shape: GemmShape, out_dtype):
    """The product's TE (C's layout: panel_major or not) and the epilogue adding the bias."""
    rows, cols, nr = shape.rows, shape.cols, shape.nr
    out_rows = shape.out_rows if shape.out_rows is not None else rows
    if shape.panel_major:
        mm = te.compute((cols // nr, rows, nr),
                        lambda p, m, j: te.sum(term(m, p, j), axis=axes),
                        name=name + "_matmul")
        out = te.compute((cols // nr, out_rows, nr),
                         lambda p, m, j: cast(mm[p, m, j] + bias[p * nr + j], out_dtype),
                         name=name)
    else:
        mm = te.compute((rows, cols),
                        lambda m, n: te.sum(term(m, n // nr, n % nr), axis=axes),
                        name=name + "_matmul")
        out = te.compute((out_rows, cols), lambda m, n: cast(mm[m, n] + bias[n], out_dtype),
                         name=name)
    return mm, out


def _f32(v):
    return cast(v, COMPUTE)
