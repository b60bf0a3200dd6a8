"""Tuning records: decisions keyed by a readable workload, kept sorted in JSON (no TVM).

A record says, for one kernel of one layer shape on one CPU class, what to use instead of the
template default: a MetaSchedule trace (TE kernels) or a template config (the attention
template). Records carry the schema, TVM and mhagen versions, the kernel's structural hash (a
record whose kernel changed is stale), the measured latencies and the machine they were
measured on (LLVM CPU name, CPU model, cache sizes).

A trace record also holds its trace's instruction count and the structural hash of the kernel
its trace scheduled ("trace_instructions", "schedule_hash"): a trace damaged since (cut short,
a decision edited) is refused even where it still replays to a kernel that computes the right
output. Trace records written before these fields are checked as before (their traces'
structure, and the output of their replay).

A record also holds the default it was measured against ("default_config": the template's
config, or the rules' configs of a TE kernel's stages). It beat that default, which says
nothing of a default changed since: when today's default differs, the record is stale and the
build uses today's default (with a TuningWarning: re-run mhagen tune).

CPU classes: the best schedule depends on the vector width and the register count, so the
class ("x86_64-v512-r32" for AVX-512, "x86_64-v256-r16" for AVX2) is part of the key and a
record of another class is never applied. Within a class, records measured on several
machines may exist for one workload, each kept (the machine's caches and LLVM CPU name are
part of where a record is stored, so tuning on a Zen 4 does not replace a Skylake-SP record
with the same caches): the one whose caches (L2, then L1d) are closest to the target's is
used, the same CPU first among equal caches, and the build says which.

Lookup order at build time: the user's database (mhagen tune writes it), then the records
shipped in schedules/<family folder>/records/<cpu class>.json, then the template default.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import warnings
from pathlib import Path

from mhagen.backends import family_of
from mhagen.errors import TargetError

SCHEMA = 3   # 3: measured records hold default_config (files of 2 are refused)
KEY_FIELDS = ("cpu_class", "dtype", "batch", "seq", "d_model", "heads", "kv_heads",
              "head_dim", "mask", "graph", "kernel", "packed", "kv_block_size")
# where a record was measured (in its key, not part of its identity): picks the closest
MACHINE_FIELDS = ("l2_kib", "l1d_kib", "cpu")


class TuningWarning(UserWarning):
    """A record could not be used (stale, corrupt, other versions): the default is used."""


def workload_key(graph, target, batch, seq, kernel, call=None) -> dict:
    """The readable key of one kernel: layer shape fields, CPU class, kernel name, and the
    target's cache sizes and CPU (Target.machine_cpu: to choose among records of several
    machines). A decoding layer's key also says its cache length (`kv_cache`: readable, so
    a record's layer can be rebuilt; the graph hash already tells cache lengths apart).
    call: how the kernel is called where that makes another workload of one shape
    (decode_call_fields: a decoding layer's packed or paged attention); its fields are part
    of the key (a record without them is the fixed, contiguous build's)."""
    o = graph.options
    canonical = json.dumps([n.to_json() for n in graph.nodes], sort_keys=True)
    return {"cpu_class": target.cpu_class, "l2_kib": target.l2_kib,
            "l1d_kib": target.l1d_kib, "cpu": target.machine_cpu, "dtype": graph.dtype,
            "batch": batch, "seq": seq, "d_model": graph.inputs[0].attrs["shape"][2],
            "heads": o.get("num_heads"), "kv_heads": o.get("kv_heads"),
            "head_dim": o.get("head_dim"),
            "mask": "causal" if o.get("causal") and "mask" not in o else o.get("mask", "none"),
            "graph": hashlib.sha256(canonical.encode()).hexdigest()[:16], "kernel": kernel,
            **({"kv_cache": o["kv_cache"]} if o.get("kv_cache") else {}), **(call or {})}


def decode_call_fields(packed: bool, kv_block_size) -> dict:
    """The key fields of a decoding layer's attention kernel that tell its builds apart where
    (batch, seq) do not: "packed" (built with seq_len=None: each batch row its own count of
    new tokens, seq the build's max_seq_len) and "kv_block_size" (a paged cache of blocks of
    that many tokens: the template's key blocks divide it). Empty for the fixed build of a
    contiguous cache, whose records keep their keys."""
    return {**({"packed": True} if packed else {}),
            **({"kv_block_size": int(kv_block_size)} if kv_block_size else {})}


def _key_str(key: dict) -> str:
    return json.dumps([key.get(f) for f in KEY_FIELDS])


def _slot(key: dict) -> str:
    """Where a record is stored: its identity and the machine it was measured on."""
    return json.dumps([key.get(f) for f in KEY_FIELDS + MACHINE_FIELDS])


def _cache_distance(a: dict, b: dict) -> float:
    """How far apart two machines' caches are (log2 ratios; L2 counts most)."""
    d = 0.0
    for weight, f in ((2.0, "l2_kib"), (1.0, "l1d_kib")):
        x, y = a.get(f), b.get(f)
        if x and y:
            d += weight * abs(math.log2(x / y))
        elif x or y:
            d += weight * 4
    return d


def describe_record(record: dict) -> str:
    """One line: which record a build used (class, where it was measured)."""
    k, m = record.get("key", {}), record.get("measured_on") or {}
    where = ", ".join(str(v) for v in (m.get("cpu"), m.get("model")) if v) or "unknown CPU"
    return (f"{k.get('kernel')}: {record.get('kind')} record for {k.get('cpu_class')}, "
            f"measured on {where} (L2 {k.get('l2_kib')} KiB"
            + (f", {k['cpu']})" if k.get("cpu") and k["cpu"] != m.get("cpu") else ")"))


def user_database_path(target_name: str) -> Path:
    """Where `mhagen tune` stores records: $MHAGEN_TUNING_DIR or ~/.cache/mhagen/tuning."""
    root = os.environ.get("MHAGEN_TUNING_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mhagen", "tuning")
    return Path(root) / f"{target_name}.json"


class Database:
    """Records of one target, in one JSON file (sorted by key, one record per key)."""

    def __init__(self, path=None, records=None):
        self.path = Path(path) if path else None
        self.records = {_slot(r["key"]): r for r in (records or [])}

    @staticmethod
    def load(path, missing_ok=True) -> "Database":
        path = Path(path)
        if not path.is_file():
            if missing_ok:
                return Database(path)
            raise FileNotFoundError(f"no tuning database at {path}")
        try:
            data = json.loads(path.read_text())
            if data.get("schema") != SCHEMA:
                raise ValueError(f"schema {data.get('schema')} (this mhagen reads {SCHEMA})")
            if not isinstance(data["records"], list):
                raise TypeError(f'"records" is a {type(data["records"]).__name__}, not a list')
            records = [r for r in data["records"] if _valid(r)]
            dropped = len(data["records"]) - len(records)
            if dropped:
                warnings.warn(f"tuning database {path}: {dropped} malformed record(s) ignored "
                              "(the defaults are used for them)", TuningWarning, stacklevel=2)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            warnings.warn(f"tuning database {path} is unreadable ({err}); ignoring it: delete "
                          "it or re-run mhagen tune", TuningWarning, stacklevel=2)
            return Database(path)
        return Database(path, records)

    def lookup(self, key: dict):
        """The record for this workload and CPU class measured on the machine with the
        closest caches (among equal caches: on the same CPU), or None."""
        want = _key_str(key)
        same = [r for r in self.records.values() if _key_str(r["key"]) == want]
        return min(same, key=lambda r: (_cache_distance(r["key"], key),
                                        r["key"].get("cpu") != key.get("cpu"),
                                        _slot(r["key"])), default=None)

    def put(self, record: dict) -> None:
        self.records[_slot(record["key"])] = record

    def save(self, path=None) -> Path:
        path = Path(path or self.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        ordered = [self.records[k] for k in sorted(self.records)]
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"schema": SCHEMA, "records": ordered}, indent=1,
                                  sort_keys=True) + "\n")
        tmp.replace(path)
        return path


def _valid(r) -> bool:
    return (isinstance(r, dict) and isinstance(r.get("key"), dict)
            and r.get("kind") in ("trace", "config", "default"))


def stale_default(record: dict, default) -> str | None:
    """Why `record` no longer applies when today's default is `default` (a JSON-able
    config), or None. mhagen tune writes default_config into every record it measures; one
    without it was written by hand (or is a candidate mhagen tune lowers): it applies."""
    if "default_config" not in record or record["default_config"] == default:
        return None
    return (f"it was measured against the default {_short(record['default_config'])}, and "
            f"today's default is {_short(default)}")


def _short(config) -> str:
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


def shipped_records_path(target) -> Path | None:
    """schedules/<family folder>/records/<cpu class>.json: the records mhagen ships for the
    target's CPU class (found, not imported: the schedules import TVM)."""
    try:
        folder = family_of(target).folder
    except TargetError:
        return None
    spec = importlib.util.find_spec("mhagen.schedules")
    if spec is None or not spec.submodule_search_locations:  # pragma: no cover
        return None
    root = Path(list(spec.submodule_search_locations)[0])
    return root / folder / "records" / f"{target.cpu_class}.json"


def shipped_database(target) -> Database:
    """The records shipped with mhagen for the target's CPU class (empty when none are)."""
    path = shipped_records_path(target)
    return Database.load(path) if path is not None and path.is_file() else Database()


class Tuning:
    """What a build consults: the user's database, then the shipped records."""

    def __init__(self, databases):
        self.databases = [d for d in databases if d is not None]

    @staticmethod
    def default(target) -> "Tuning":
        return Tuning([Database.load(user_database_path(target.name)),
                       shipped_database(target)])

    @staticmethod
    def none() -> "Tuning":
        return Tuning([])

    def lookup(self, key: dict):
        for db in self.databases:
            rec = db.lookup(key)
            if rec is not None:
                return rec
        return None
