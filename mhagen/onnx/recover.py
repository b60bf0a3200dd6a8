"""Import stage 3, weight recovery: read the weights exactly from the initializers
(initializers.py) where the layout allows it, else fit them by least squares on probe runs
(fit.py). The returned Recovered says which (``source``) and, for a fit, why (``detail``).
"""
from __future__ import annotations

from mhagen.onnx.fit import fit_block, probe_runs
from mhagen.onnx.initializers import NotReadable, read_block


def recover_weights(m, blk, specs, prober, shapes, first, rng, batch):
    """The weights of layer `blk` (a Recovered), exactly when possible."""
    try:
        return read_block(m, blk, specs, first, batch)
    except NotReadable as why:
        runs = probe_runs(blk, prober, shapes, first, rng, specs)
        rec = fit_block(blk, runs, specs, batch)
        rec.detail = str(why)
        return rec
