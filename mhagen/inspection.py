"""Inspection: one stage of a module as text (graph, te, tir, source, schedule, manifest).
The texts an artifact stores (TEXT_FILES, source_text) and its manifest are the artifact
package's (mhagen/artifact/files.py, manifest.py): inspection reads them, the artifact never
imports inspection."""
from __future__ import annotations

import json

from mhagen.artifact.files import TEXT_FILES, source_text
from mhagen.artifact.manifest import module_manifest
from mhagen.errors import ArtifactError

INSPECT_KINDS = ("graph", "te", "tir", "source", "schedule", "manifest")
__all__ = ["INSPECT_KINDS", "TEXT_FILES", "inspect", "schedule_text", "source_text"]


def schedule_text(module) -> str:
    lines = [module.program.fusion]
    lines += [f"{d['kernel']:<18} {d['stage']:<16} {d['rule']:<12} {d['config']}"
              for d in module.info.decisions]
    return "\n".join(lines)


def inspect(module, what: str = "graph") -> str:
    if what not in INSPECT_KINDS:
        raise ValueError(f"inspect() takes one of {', '.join(INSPECT_KINDS)}, got {what!r}")
    if what == "graph":
        return str(module.graph)
    if what == "schedule":
        return schedule_text(module)
    if what == "manifest":
        return json.dumps(module_manifest(module), indent=1)
    if what == "source":
        return source_text(module)
    if what not in module.info.texts:
        raise ArtifactError(f"this module carries no {what} text")
    return module.info.texts[what]
