"""Inspection: one stage of a module as text (graph, te, tir, source, schedule, manifest)."""
from __future__ import annotations

import json

from mhagen.artifact.manifest import module_manifest
from mhagen.errors import ArtifactError

INSPECT_KINDS = ("graph", "te", "tir", "source", "schedule", "manifest")
TEXT_FILES = ("te", "tir", "source")   # saved beside kernel.so as <what>.txt


def source_text(module) -> str:
    """The kernels' assembly: from the build, the saved source.txt, or the library."""
    texts = module.info.texts
    if not texts.get("source") and module.info.executable is not None:
        texts["source"] = module.info.executable.mod.inspect_source("asm")
    return texts.get("source", "")


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
