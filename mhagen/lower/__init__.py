"""Lowering: a verified graph -> passes -> a Program of kernels (TE PrimFuncs or templates).

Target-neutral: what depends on the target (the GEMM tile and row padding, the head padding,
whether an attention template exists) comes from the target's backend (mhagen/backends.py).
"""
from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass

from mhagen.errors import GraphError
from mhagen.ir.unfuse import unfuse
from mhagen.lower.fused import NotFusable, lower_fused
from mhagen.lower.te import lower_unfused
from mhagen.passes import run_passes
from mhagen.program import Buffer, Kernel, Program, Stage
from mhagen.records.database import (TuningWarning, decode_call_fields, stale_default,
                                     workload_key)


def lower(graph, batch: int, seq_len: int, target, fuse: bool = True, tuning=None,
          symbolic=None, kv_seq_len: int | None = None, backend=None,
          kv_block_size: int | None = None) -> Program:
    """Fused kernels when the passes recognise the graph, else one unfused kernel (a graph
    with the fused kinds: those of its builder form, mhagen/ir/unfuse.py).
    `tuning` (mhagen.records.database.Tuning) may supply the attention template's config (the
    decode template's, for a decoding layer).
    symbolic ({"batch": bool, "seq": bool}): batch and seq_len are the largest call's; the
    fused kernels take the call's (mhagen/lower/fused.py). kv_seq_len: the context's length
    of a cross-attention layer (its programs consult no tuning records yet). backend: the
    target's (mhagen.backends.Backend; made from the target when not given).
    kv_block_size: a decoding layer built for a paged cache of blocks of that many tokens
    (mhagen.PagedKVCache). A decoding layer's packed (seq_len=None) and paged builds consult
    records of their own: their attention's key says packed and kv_block_size."""
    cross = graph.context_input is not None
    # a decoding layer's packed or paged attention: records of its own (their keys say so)
    call = decode_call_fields(bool(symbolic and symbolic.get("seq")), kv_block_size) \
        if graph.cache_lens_input is not None else {}
    graph.shapes(**graph.dims(batch, seq_len, kv_seq_len))
    graph = unfuse(graph)    # a graph holding the fused kinds compiles as its builder form
    fusion = run_passes(graph, fuse=fuse)
    backend = backend or target.backend()
    rule = backend.attention if fusion.fused else None

    reason = fusion.reason if rule is not None or not fusion.fused else \
        "not fused: no attention template for this target"
    program = None
    if fusion.fused and rule is not None:
        tuned_rule = backend.decode if graph.cache_lens_input is not None else rule
        config = None if cross or tuned_rule is None else _tuned_config(
            tuned_rule, tuning, workload_key(graph, target, batch, seq_len, "attention", call),
            target)
        # a symbolic prefill build's packed calls (mhagen/packed.py): their attention's own
        # record (a decoding layer's packed calls run the decode template)
        packed_config = None
        if symbolic and not cross and graph.cache_lens_input is None:
            packed_config = _tuned_config(rule, tuning, workload_key(
                graph, target, batch, seq_len, "attention_varlen"), target)
        try:
            program = lower_fused(fusion.graph, batch, seq_len, backend, config,
                                  symbolic=symbolic, kv_seq=kv_seq_len,
                                  kv_block_size=kv_block_size, packed_config=packed_config)
        except NotFusable as why:
            reason = f"not fused: {why}"
    if program is None and graph.cache_lens_input is not None:
        raise GraphError(f"decoding layers (a K/V cache) compile through the fused kernels "
                         f"only, and this one was {reason}; build it with fuse=True from "
                         "mhagen.mha(..., kv_cache=N) or a graph of that form")
    if program is None and kv_block_size:
        raise GraphError(f"kv_block_size= builds a decoding layer (kv_cache=) for a paged "
                         f"cache, and this one was {reason}")
    if program is None and symbolic:
        raise GraphError(f"symbolic lengths (seq_len=None or batch=None) need the fused "
                         f"kernels, and this layer was {reason}; build it for one length "
                         "(seq_len=N)")
    if program is None:
        program = lower_unfused(graph, batch, seq_len, kv_seq_len)
    program.key_parts = None if cross else (graph, target, batch, seq_len, {"attention": call})
    program.fusion = reason
    return program


def _tuned_config(rule, tuning, key, target):
    """None (the default), or a TunedConfig: the attention config a tuning record asks for,
    given today's default config."""
    record = tuning.lookup(key) if tuning is not None else None
    if record is None or record.get("kind") != "config":
        return None
    return TunedConfig(rule, record, key, target)


@dataclass(frozen=True)
class TunedConfig:
    """A tuning record's attention config, for lower_fused to ask once the default config
    and the workload are known: None where the record is invalid or was measured against
    another default (stale; both warn)."""
    rule: object
    record: dict
    key: dict
    target: object

    def __call__(self, default, workload):
        why = stale_default(self.record, asdict(default))
        if why is None:
            try:
                return self.rule.make_config(self.record["config"], self.target, workload)
            except (KeyError, TypeError, ValueError) as err:
                why = f"it is invalid ({err})"
        warnings.warn(f"tuning record for {self.key['kernel']} not used: {why}; using the "
                      "default config (re-run `mhagen tune` to refresh it)", TuningWarning,
                      stacklevel=5)
        return None


__all__ = ["Buffer", "Kernel", "Program", "Stage", "lower"]
