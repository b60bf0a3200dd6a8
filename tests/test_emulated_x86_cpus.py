"""Older and smaller x86 CPUs on any x86-64 host, emulated by qemu-x86_64 (TCG): `-cpu
EPYC-v1`, an AMD Zen 1 (LLVM `znver1`: AVX2 + FMA, 16 ymm registers, no AVX-512; the CPU
issue 11 was found on); `SandyBridge-v1` (AVX, no AVX2/FMA/F16C); `Nehalem-v1` (SSE4.2, no
AVX). TCG runs what the model has and raises SIGILL on the rest, as that CPU would, while
/proc/cpuinfo still describes the host (AVX-512 on most CI machines).

Checked there: the host preset `x86` resolves to the CPU's class and matches the reference
(examples/cpu_classes.py), AVX2 artifacts run from Python and from the C API, and code
needing features a CPU lacks gets a clear error from both, never SIGILL. Only the process
started under qemu is emulated (a child it starts, such as gcc, runs natively); on a host
that is itself AVX2-only the AVX2-only checks run natively instead. qemu-user
comes with .ci/setup-arm.sh; without it these tests skip (fail when CI is set).
"""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mhagen
from mhagen.host import (X86_FEATURES, _cpuinfo_field, cpu_reported_features, host_arch,
                         runtime_features)
from mhagen.target import Target, host_llvm_cpu, resolve
from mhagen.tolerances import assert_close
from tests.conftest import build_c_app, random_input, unavailable

ROOT = Path(__file__).resolve().parents[1]
AVX2_ONLY_CPU = "EPYC-v1"
SIGILL = (132, -4)      # a shell's 128 + SIGILL, or Python's -SIGILL

pytestmark = pytest.mark.skipif(host_arch() != "x86_64", reason="emulates an x86-64 CPU")


@pytest.fixture(scope="module")
def qemu():
    path = shutil.which("qemu-x86_64")
    if path is None:
        unavailable("qemu-x86_64 not installed; apt-get install qemu-user (.ci/setup-arm.sh)")
    return path


def _on_cpu(qemu, cpu, argv):
    """argv run under qemu's `cpu`, or natively where cpu is None; never SIGILL."""
    emulate = [qemu, "-cpu", cpu] if cpu else []
    r = subprocess.run([*emulate, *map(str, argv)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode not in SIGILL, f"SIGILL on {cpu}:\n{r.stdout}\n{r.stderr}"
    return r


def _host_is_avx2_only() -> bool:
    """This CPU runs the x86-avx2 preset's code and not the x86-avx512 one's."""
    return resolve("x86-avx2").runs_here() and not resolve("x86-avx512").runs_here()


def _on_avx2_only_cpu(qemu, argv):
    """argv on an AVX2-only CPU: qemu's Zen 1, or this CPU natively where it is one (a Zen
    3: the real thing instead of the model, and about 8x faster; these three tests took
    156 s under qemu there)."""
    return _on_cpu(qemu, None if _host_is_avx2_only() else AVX2_ONLY_CPU, argv)


def _c_app(tmp_path, artifact):
    """The C example app built against `artifact` (natively, with the host's gcc)."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        unavailable("no C compiler (gcc) for the C example app")
    return build_c_app(cc, artifact, tmp_path / f"app-{Path(artifact).name}")


def test_features_the_cpu_denies_are_missing_whatever_cpuinfo_lists(monkeypatch):
    """A feature counts when /proc/cpuinfo lists it and the CPU (mhagen's CPUID/XGETBV
    probe, numpy's detection) does not deny it."""
    reported = cpu_reported_features()
    if "avx2" in reported:     # numpy says what this x86 CPU has
        assert reported["avx2"] == ("avx2" in runtime_features())
    runtime_features.cache_clear()
    try:
        monkeypatch.setattr("mhagen.host._cpuinfo_field",
                            lambda *keys: "fpu sse2 avx avx2 fma avx512f avx512bw")
        monkeypatch.setattr("mhagen.host.cpuid_features", lambda: {})    # CPUID not asked
        monkeypatch.setattr("mhagen.host.cpu_reported_features",
                            lambda: {f: False for f in ("avx512f", "avx512bw", "avx2")})
        assert runtime_features() == ("avx", "fma")
        monkeypatch.setattr("mhagen.host.cpu_reported_features", lambda: {})   # numpy silent
        runtime_features.cache_clear()
        assert runtime_features() == ("avx", "avx2", "avx512bw", "avx512f", "fma")
        monkeypatch.setattr("mhagen.host.cpuid_features", lambda: {"avx512f": False})
        runtime_features.cache_clear()
        assert runtime_features() == ("avx", "avx2", "avx512bw", "fma")
    finally:
        monkeypatch.undo()
        runtime_features.cache_clear()


@pytest.mark.slow
def test_the_cpu_classes_example_on_an_avx2_only_cpu(qemu):
    """~50 s: TVM builds two modules under the emulator: the host preset's and the AVX-512
    one it cannot run (x86-avx2 code on this CPU: test_artifacts_on_an_avx2_only_cpu)."""
    r = _on_avx2_only_cpu(qemu, [sys.executable, ROOT / "examples" / "cpu_classes.py", "x86",
                                 "x86-avx512"])
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    cpu = host_llvm_cpu() if _host_is_avx2_only() else "znver1"
    assert f"x86: class x86_64-v256-r16 (LLVM cpu {cpu}" in out, out
    assert len(re.findall(r"max error \S+ \(tolerance \S+\) ok", out)) == 1, out
    avx512 = out[out.index("x86-avx512: class x86_64-v512-r32"):]
    assert "not run here: " in avx512 and "needs CPU features avx512" in avx512, out


LOAD_AND_RUN = """
import sys, numpy as np, mhagen
x = np.load(sys.argv[1])
for artifact, out in zip(sys.argv[2::2], sys.argv[3::2]):
    try:
        np.save(out, mhagen.load(artifact)(x))
        print(artifact, "ran")
    except mhagen.ArtifactError as err:
        print(artifact, "refused:", err)
"""


def test_artifacts_on_an_avx2_only_cpu(qemu, tmp_path):
    """AVX2 and AVX-512 artifacts of one layer (head_dim 40, seq 97), built here, loaded
    there from Python and from the C example app."""
    layer = mhagen.mha(160, 4, causal=True)
    w = layer.init_weights(1)
    x = random_input(layer, 1, 97, seed=2)
    expected = layer.reference(x, w)
    np.save(tmp_path / "x.npy", x)
    x.tofile(tmp_path / "x.f32")
    dirs = {}
    for preset in ("x86-avx2", "x86-avx512"):
        m = mhagen.build(layer, preset, batch=1, seq_len=97, weights=w, tuning=None)
        dirs[preset] = m.save(tmp_path / preset)

    outs = {p: tmp_path / f"{p}.y.npy" for p in dirs}
    r = _on_avx2_only_cpu(qemu, [sys.executable, "-c", LOAD_AND_RUN, tmp_path / "x.npy",
                                 dirs["x86-avx2"], outs["x86-avx2"],
                                 dirs["x86-avx512"], outs["x86-avx512"]])
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{dirs['x86-avx2']} ran" in r.stdout, r.stdout
    assert_close(np.load(outs["x86-avx2"]), expected)
    refused = r.stdout[r.stdout.index(f"{dirs['x86-avx512']} refused:"):]
    assert "needs CPU features avx512bw, avx512cd, avx512dq, avx512f, avx512vl" in refused, r.stdout
    assert "'x86-avx2'" in refused, r.stdout         # ... and says what to build instead

    for preset, d in dirs.items():
        y = tmp_path / f"{preset}.y.f32"
        r = _on_avx2_only_cpu(qemu, [_c_app(tmp_path, d), d, tmp_path / "x.f32", y])
        if preset == "x86-avx2":
            assert r.returncode == 0, r.stderr
            assert_close(np.fromfile(y, np.float32).reshape(expected.shape), expected)
        else:
            assert r.returncode == 1 and not y.exists(), r.stdout + r.stderr
            assert "MHA_ERR_TARGET" in r.stderr and "avx512f" in r.stderr, r.stderr


RESOLVE_THIS_CPU = """
import json, mhagen
t = mhagen.target.resolve("x86")
print(t.cpu, t.cpu_class, ",".join(t.required_features()))
print(json.dumps(t.to_dict()))
"""


@pytest.mark.slow
def test_code_for_a_sandy_bridge_is_refused_on_a_nehalem(qemu, tmp_path):
    """~40 s. `x86` resolved on an AVX CPU without AVX2 needs AVX (it was listed as needing
    nothing, and died of SIGILL on a CPU without AVX). The target the emulated CPU resolved
    is built here (compiling under the emulator took a minute; the code is the same)."""
    r = _on_cpu(qemu, "SandyBridge-v1", [sys.executable, "-c", RESOLVE_THIS_CPU])
    assert r.returncode == 0, r.stderr
    first, resolved = r.stdout.splitlines()
    cpu, cpu_class, features = first.split()
    assert (cpu, cpu_class) == ("sandybridge", "x86_64-v256-r16")
    assert "avx" in features.split(",") and "avx2" not in features.split(","), features
    target = Target.from_dict(json.loads(resolved))
    layer = mhagen.mha(64, 4)
    m = mhagen.build(layer, target, batch=1, seq_len=16, weights=layer.init_weights(0),
                     tuning=None)
    assert m.target.required_features() == tuple(features.split(","))
    art = m.save(tmp_path / "snb")
    x = random_input(layer, 1, 16, seed=4)
    np.save(tmp_path / "x.npy", x)
    x.tofile(tmp_path / "x.f32")
    r = _on_cpu(qemu, "Nehalem-v1", [sys.executable, "-c", LOAD_AND_RUN, tmp_path / "x.npy",
                                     art, tmp_path / "y.npy"])
    assert r.returncode == 0, r.stderr
    assert f"{art} refused:" in r.stdout and "needs CPU features avx" in r.stdout, r.stdout
    assert "build for target 'x86' (this CPU) instead" in r.stdout, r.stdout
    r = _on_cpu(qemu, "Nehalem-v1", [_c_app(tmp_path, art), art, tmp_path / "x.f32",
                                     tmp_path / "y.f32"])
    assert r.returncode == 1 and "MHA_ERR_TARGET" in r.stderr and "avx" in r.stderr, r.stderr


PROBE = """#include <cstdio>
#include "mha_config.h"
#include "mha_cpu.h"
int main() { std::printf("%s\\n", mha::missing_cpu_features().c_str()); }
"""
PYTHON_FEATURES = """
from mhagen.host import cpu_reported_features, cpuid_features, runtime_features
print(' '.join(runtime_features()))
asked, numpy = cpuid_features(), cpu_reported_features()
print(len(asked), ' '.join(sorted(f for f in numpy if f in asked and asked[f] != numpy[f])))
"""


@pytest.fixture(scope="module")
def cpu_probe(tmp_path_factory):
    """The C API's CPU check (mha_cpu.h) built alone, asked for every x86 feature mhagen
    knows: it prints the ones the CPU it runs on lacks."""
    from mhagen.artifact import capi
    from mhagen.host import X86_FEATURES
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        unavailable("no C++ compiler (g++) for the CPU probe")
    d = tmp_path_factory.mktemp("probe")
    every = sorted(X86_FEATURES)
    x86, _, _, unchecked = capi._cpu_features({"target": {"arch": "x86_64", "features": every}})
    assert [f[0] for f in x86] == every and not unchecked
    (d / "mha_config.h").write_text(capi._cpu_check({"target": {"arch": "x86_64",
                                                                "features": every}}))
    shutil.copy(capi.RUNTIME_DIR / "mha_cpu.h", d)
    (d / "probe.cc").write_text(PROBE)
    r = subprocess.run([cxx, "-std=c++17", "-O2", "-Wall", "-Werror", f"-I{d}", str(d / "probe.cc"),
                        "-o", str(d / "probe")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return d / "probe", every


@pytest.mark.parametrize("cpu", [None, AVX2_ONLY_CPU, "SandyBridge-v1", "Nehalem-v1"])
def test_the_c_api_and_python_agree_on_what_a_cpu_lacks(qemu, cpu_probe, cpu):
    """The C API's CPUID/XGETBV check and mhagen's (/proc/cpuinfo, its own CPUID probe
    and numpy) name the same missing features, for every x86 feature, on this CPU and on
    emulated ones; the probe's table (shared with the C API) agrees with numpy's
    independent detection on every feature numpy knows, so a wrong CPUID bit in it shows."""
    probe, every = cpu_probe
    r = _on_cpu(qemu, cpu, [probe])
    assert r.returncode == 0, r.stderr
    c_missing = set(r.stdout.split())
    r = _on_cpu(qemu, cpu, [sys.executable, "-c", PYTHON_FEATURES])
    assert r.returncode == 0, r.stderr
    features, (asked, *disagree) = (line.split() for line in r.stdout.splitlines())
    python_missing = set(every) - set(features)
    # mhagen also needs the kernel's /proc/cpuinfo to list a feature, and under qemu that is
    # the host's list: an emulated CPU's feature the host lacks (Zen 1's SSE4a on an Intel
    # host) the C API finds and mhagen refuses, the safe side
    listed = set(_cpuinfo_field("flags", "Features").split())
    unlisted = {f for f in every if X86_FEATURES[f].cpuinfo not in listed}
    assert c_missing | unlisted == python_missing, (cpu, sorted((c_missing | unlisted)
                                                                ^ python_missing))
    assert int(asked) == len(every) and not disagree, (cpu, disagree)
    assert "avx512bf16" in c_missing or "avx512f" not in c_missing    # BF16 needs AVX-512
    if cpu:      # what each emulated CPU is
        has = {AVX2_ONLY_CPU: {"avx2", "fma", "movbe", "lzcnt"}, "SandyBridge-v1": {"avx"},
               "Nehalem-v1": {"sse4.2", "popcnt"}}[cpu]
        assert not has & c_missing and "avx512f" in c_missing, (cpu, c_missing)


def test_tuning_avx512_code_on_an_avx2_only_cpu_is_a_clear_error(qemu, tmp_path):
    """`mhagen tune --target x86-avx512` measured its candidates here and died of SIGILL."""
    r = _on_avx2_only_cpu(qemu, [sys.executable, "-m", "mhagen", "tune", "--target",
                                 "x86-avx512", "--d-model", "64", "--heads", "4", "--shapes",
                                 "1x16", "--trials", "1", "--kernels", "attention", "--db",
                                 tmp_path / "db.json"])
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert "cannot tune x86-avx512 here" in r.stderr and "avx512f" in r.stderr, r.stderr


@pytest.mark.slow
def test_a_cpu_llvm_does_not_know_gets_avx2_code(qemu):
    """qemu's `-cpu max` (AVX2, FMA; a family and model LLVM does not know) was named
    "k8-sse3" and got SSE3 code (class v128-r16); it now gets x86-64-v3 (AVX2). The target
    it resolves is built and checked here (examples/cpu_classes.py builds under the
    emulator: test_the_cpu_classes_example_on_an_avx2_only_cpu)."""
    r = _on_cpu(qemu, "max", [sys.executable, "-c", RESOLVE_THIS_CPU])
    assert r.returncode == 0, r.stdout + r.stderr
    first, resolved = r.stdout.splitlines()
    # qemu 7.2's max: x86-64-v3 (a later qemu's max may be a CPU LLVM knows: same class)
    assert first.split()[1] == "x86_64-v256-r16", first
    target = Target.from_dict(json.loads(resolved))
    assert {"avx2", "fma"} <= set(target.required_features()), target
    layer = mhagen.mha(64, 4, causal=True)
    w = layer.init_weights(0)
    m = mhagen.build(layer, target, batch=1, seq_len=24, weights=w, tuning=None)
    # mhagen counts a feature only where /proc/cpuinfo (the host's, under qemu) lists it
    assert m.cannot_run is None, m.cannot_run
    x = random_input(layer, 1, 24, seed=1)
    assert_close(m(x), layer.reference(x, w))
