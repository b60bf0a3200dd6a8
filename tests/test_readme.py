"""The documentation (the READMEs, docs/*.md, benchmarks/PERFORMANCE.md) names only what
exists: every `mhagen.<name>` it uses resolves, the Python blocks parse and pass only
keywords their functions take, every `mhagen <command>` line uses real options, and every
repository path named is there. (A reader copies these;
a rename that forgets them would otherwise go unnoticed.)"""
import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

import mhagen
from mhagen.cli import parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "benchmarks" / "README.md", ROOT / "benchmarks" / "PERFORMANCE.md",
        ROOT / "examples" / "c_app" / "README.md"]
# mhagen's wrappers whose keywords the compiler's functions take
FORWARDED = {"build": "mhagen.compile.build", "tune": "mhagen.tuning.search.tune"}


def _text(doc: Path) -> str:
    return doc.read_text()


def _python_blocks(doc: Path):
    """(first line number, source) of each ```python block."""
    lines, out, start = _text(doc).splitlines(), [], None
    for i, line in enumerate(lines, 1):
        if start is None and line.strip() == "```python":
            start = i
        elif start is not None and line.strip() == "```":
            out.append((start + 1, "\n".join(lines[start:i - 1])))
            start = None
    return out


def _resolve(dotted: str):
    """The object `mhagen.a.b.c` names (attributes, else submodules), or raise."""
    obj, path = mhagen, "mhagen"
    for part in dotted.split(".")[1:]:
        path = f"{path}.{part}"
        if not hasattr(obj, part):
            importlib.import_module(path)   # a submodule not imported yet
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_mhagen_name_the_docs_use_exists(doc):
    names = set(re.findall(r"(?<![\w.])mhagen(?:\.[A-Za-z_]\w*)+", _text(doc)))
    assert names, "the check reads the names"
    missing = []
    for name in sorted(names):
        try:
            _resolve(name)
        except (AttributeError, ImportError) as err:
            missing.append(f"{name} ({err})")
    assert not missing, f"{doc.name} names what does not exist: {missing}"


def _mhagen_calls(tree):
    """(function name, keywords, line) of every call mhagen.f(...)."""
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "mhagen"):
            yield node.func.attr, [k.arg for k in node.keywords if k.arg], node.lineno


def test_python_blocks_parse_and_call_with_keywords_their_functions_take():
    blocks = [(doc, line, src) for doc in DOCS for line, src in _python_blocks(doc)]
    assert len(blocks) >= 8, "the check reads the docs' Python blocks"
    wrong, calls = [], 0
    for doc, first, src in blocks:
        tree = ast.parse(src, filename=f"{doc.name}:{first}")   # a SyntaxError fails here
        for name, keywords, line in _mhagen_calls(tree):
            calls += 1
            fn = _resolve(FORWARDED.get(name, f"mhagen.{name}"))
            params = inspect.signature(fn).parameters
            if any(p.kind is p.VAR_KEYWORD for p in params.values()):
                continue
            wrong += [f"{doc.name}:{first + line - 1}: mhagen.{name}(... {k}=)"
                      for k in keywords if k not in params]
    assert calls >= 20, calls
    assert not wrong, f"keywords these functions do not take: {wrong}"


def _cli_options():
    """{command: set of its option strings}."""
    sub = next(a for a in parser()._actions if a.dest == "command")
    return {name: set(p._option_string_actions) for name, p in sub.choices.items()}


def test_command_lines_in_the_docs_use_real_commands_and_options():
    options = _cli_options()
    found, wrong = 0, []
    for doc in DOCS:
        for line in _text(doc).splitlines():
            for command, rest in re.findall(r"\bmhagen ([a-z][a-z-]+)\b([^`#\n]*)", line):
                if command not in options:
                    continue   # prose ("mhagen ships ...")
                found += 1
                wrong += [f"{doc.name}: mhagen {command} {flag}"
                          for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest)
                          if flag not in options[command]]
    assert found >= 15, found
    assert not wrong, f"options these commands do not have: {wrong}"


def test_every_repository_path_the_docs_name_exists():
    pattern = (r"(?<![\w/~.])((?:mhagen|schedules|targets|tests|examples|benchmarks|scripts)/"
               r"[\w./-]*\.(?:py|json|md|c|cpp|h|sh|txt))\b")
    missing, found = [], 0
    for doc in DOCS:
        for path in set(re.findall(pattern, _text(doc))):
            found += 1
            here = [ROOT / path, doc.parent / path]
            if not any(p.exists() for p in here):
                missing.append(f"{doc.name}: {path}")
    assert found >= 30, found
    assert not missing, f"paths that do not exist: {missing}"
