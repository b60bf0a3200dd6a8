"""Tuning records: decisions keyed by a readable workload, kept sorted in JSON (no TVM).

A record says, for one kernel of one layer shape on one target preset, what to use instead
of the template default: a MetaSchedule trace (TE kernels) or a template config (the
attention template). Records carry the schema, TVM and mhagen versions, the kernel's
structural hash (a record whose kernel changed is stale) and the measured latencies.

Lookup order at build time: the user's database (mhagen tune writes it), then the records
shipped in schedules/<target>/tuned.json, then the template default.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from importlib import resources
from pathlib import Path

SCHEMA = 1
KEY_FIELDS = ("target", "vector_bits", "dtype", "batch", "seq", "d_model", "heads",
              "kv_heads", "head_dim", "mask", "graph", "kernel")


class TuningWarning(UserWarning):
    """A record could not be used (stale, corrupt, other versions): the default is used."""


def workload_key(graph, target, batch, seq, kernel) -> dict:
    """The readable key of one kernel: layer shape fields, target preset, kernel name."""
    o = graph.options
    canonical = json.dumps([n.to_json() for n in graph.nodes], sort_keys=True)
    return {"target": target.name, "vector_bits": target.vector_bits, "dtype": graph.dtype,
            "batch": batch, "seq": seq, "d_model": graph.inputs[0].attrs["shape"][2],
            "heads": o.get("num_heads"), "kv_heads": o.get("kv_heads"),
            "head_dim": o.get("head_dim"),
            "mask": "causal" if o.get("causal") and "mask" not in o else o.get("mask", "none"),
            "graph": hashlib.sha256(canonical.encode()).hexdigest()[:16], "kernel": kernel}


def _key_str(key: dict) -> str:
    return json.dumps([key.get(f) for f in KEY_FIELDS])


def user_database_path(target_name: str) -> Path:
    """Where `mhagen tune` stores records: $MHAGEN_TUNING_DIR or ~/.cache/mhagen/tuning."""
    root = os.environ.get("MHAGEN_TUNING_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mhagen", "tuning")
    return Path(root) / f"{target_name}.json"


class Database:
    """Records of one target, in one JSON file (sorted by key, one record per key)."""

    def __init__(self, path=None, records=None):
        self.path = Path(path) if path else None
        self.records = {_key_str(r["key"]): r for r in (records or [])}

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
            records = [r for r in data["records"] if _valid(r)]
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            warnings.warn(f"tuning database {path} is unreadable ({err}); ignoring it: delete "
                          "it or re-run mhagen tune", TuningWarning, stacklevel=2)
            return Database(path)
        return Database(path, records)

    def lookup(self, key: dict):
        return self.records.get(_key_str(key))

    def put(self, record: dict) -> None:
        self.records[_key_str(record["key"])] = record

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


def shipped_database(target_name: str) -> Database:
    """The records shipped with mhagen for a target preset (schedules/<arch>/tuned.json)."""
    try:
        path = resources.files("mhagen.schedules") / "x86" / "tuned.json"
    except (ModuleNotFoundError, FileNotFoundError):  # pragma: no cover
        return Database()
    if target_name.startswith("x86") and path.is_file():
        return Database.load(Path(str(path)))
    return Database()


class Tuning:
    """What a build consults: the user's database, then the shipped records."""

    def __init__(self, databases):
        self.databases = [d for d in databases if d is not None]

    @staticmethod
    def default(target_name: str) -> "Tuning":
        return Tuning([Database.load(user_database_path(target_name)),
                       shipped_database(target_name)])

    @staticmethod
    def none() -> "Tuning":
        return Tuning([])

    def lookup(self, key: dict):
        for db in self.databases:
            rec = db.lookup(key)
            if rec is not None:
                return rec
        return None
