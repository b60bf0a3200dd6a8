"""The float64 numpy oracle, by its public path: every compiled path is compared against
run_reference (layer.reference(...) calls it). It lives with the node kinds whose semantics
it defines, mhagen/ir/reference.py; this module only names it (mhagen.reference imports
mhagen.ir, never the reverse)."""
from mhagen.ir.reference import (apply_score_mod, mask_grid, packed_refusal, positions,
                                 run_packed_reference, run_reference, softmax_rows)

__all__ = ["apply_score_mod", "mask_grid", "packed_refusal", "positions",
           "run_packed_reference", "run_reference", "softmax_rows"]
