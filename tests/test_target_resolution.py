"""x86 CPU classes and features: both presets built and checked wherever the host runs
them, the class and features a preset or this host resolves to, and code that needs
features a CPU lacks refused clearly (module, artifact, C API) instead of SIGILL."""
import re

import pytest

import mhagen
from mhagen.errors import TargetError
from mhagen.artifact.manifest import module_manifest
from mhagen.host import runtime_features
from mhagen.target import resolve
from mhagen.tolerances import assert_close
from x86_helpers import PRESETS, _input


CLASSES = {"x86-avx2": "x86_64-v256-r16", "x86-avx512": "x86_64-v512-r32"}


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("layer_args, batch, seq", [
    (dict(d_model=320, num_heads=8, head_dim=40), 2, 97),                     # awkward shape
    (dict(d_model=256, num_heads=8, kv_heads=2, causal=True), 1, 130),       # grouped, causal
])
def test_both_presets_match_the_reference_or_refuse_clearly(preset, layer_args, batch, seq):
    layer = mhagen.mha(**layer_args)
    w = layer.init_weights(1)
    m = mhagen.build(layer, preset, batch=batch, seq_len=seq, weights=w, tuning=None)
    assert m.target.cpu_class == CLASSES[preset]
    x = _input(batch, seq, layer_args["d_model"])
    if m.target.runs_here():
        assert_close(m(x), layer.reference(x, w))
    else:   # e.g. the AVX-512 preset on an AVX2 host: a clear error, never SIGILL
        assert m.cannot_run and "avx512f" in m.cannot_run
        with pytest.raises(TargetError, match="needs CPU features .*avx512f"):
            m(x)


def test_avx512_code_on_an_avx2_host_raises_instead_of_sigill(monkeypatch, tmp_path):
    avx2_host = tuple(f for f in runtime_features() if not f.startswith("avx512"))
    monkeypatch.setattr("mhagen.host.runtime_features", lambda: avx2_host)
    layer = mhagen.mha(64, 4)
    m = mhagen.build(layer, "x86-avx512", batch=1, seq_len=16, weights=layer.init_weights(0))
    assert not m.target.runs_here()
    assert m.target.missing_features()[0].startswith("avx512")
    with pytest.raises(TargetError, match=r"needs CPU features avx512.*x86-avx2"):
        m(_input(1, 16, 64))
    with pytest.raises(TargetError, match="avx512"):
        m.latency()
    m.save(tmp_path / "m")          # cross-class artifacts are still written ...
    with pytest.raises(mhagen.ArtifactError, match="needs CPU features .*avx512"):
        mhagen.load(tmp_path / "m")  # ... and refused where they cannot run
    ok = mhagen.build(layer, "x86-avx2", batch=1, seq_len=16, weights=layer.init_weights(0))
    assert ok.cannot_run is None


def test_a_cpu_without_avx2_is_not_told_to_build_for_avx2(monkeypatch):
    """Sandy Bridge (AVX, no AVX2/FMA): the refusal of AVX2 code suggests 'x86' only (qemu
    -cpu SandyBridge-v1 showed the message suggesting 'x86-avx2' too)."""
    from mhagen.targets import load_preset, preset_names
    fallbacks = [n for n in preset_names() if load_preset(n).get("fallback") is not None]
    assert {"x86", "x86-avx2", "arm-neon"} <= set(fallbacks)
    for name in fallbacks:        # the preset's "fallback" list is what its code needs
        preset = load_preset(name)
        needs = () if preset["tvm"]["mcpu"] == "host" else resolve(name).required_features()
        assert tuple(preset["fallback"]) == needs, f"{name} needs {needs}"
    monkeypatch.setattr("mhagen.host.runtime_features",
                        lambda: ("avx", "popcnt", "sse4.1", "sse4.2", "ssse3"))
    layer = mhagen.mha(64, 4)
    m = mhagen.build(layer, "x86-avx2", batch=1, seq_len=8, tuning=None)
    assert m.cannot_run.endswith("needs CPU features avx2, bmi, bmi2, f16c, fma, lzcnt, movbe "
                                 "that this "
                                 "machine lacks (an "
                                 "instruction it lacks would kill the process with SIGILL): "
                                 "build for target 'x86' (this CPU) instead"), m.cannot_run


def test_zen_code_needs_sse4a_and_the_bf16_preset_leaves_it_out():
    """LLVM writes AMD's SSE4a (insertq) into code for Zen: a bfloat16 layer for znver4 had
    it and died of SIGILL on an Intel Xeon with every other Zen 4 extension. sse4a is a
    checked feature now (code for Zen lists it; a CPU without it refuses the module), and
    the x86-avx512-bf16 preset (znver4) turns it off, so its code runs on such a Xeon."""
    from mhagen.target import _checked_features
    assert "sse4a" in _checked_features({"kind": "llvm", "mtriple": "x86_64-linux-gnu",
                                         "mcpu": "znver4"})
    layer = mhagen.mha(8, 1, dtype="bfloat16")
    m = mhagen.build(layer, "x86-avx512-bf16", batch=1, seq_len=7,
                     weights=layer.init_weights(0), tuning=None)
    asm = m.inspect("source")
    assert "vdpbf16ps" in asm and not re.search(r"\b(insertq|extrq)\b", asm)
    assert "sse4a" not in m.target.required_features()


def test_avx512_bf16_code_is_refused_on_an_avx512_cpu_without_it(monkeypatch, tmp_path):
    """A bfloat16 layer for an AVX-512 BF16 CPU multiplies with vdpbf16ps. Its code listed only
    AVX-512 F/BW/DQ/VL as needed, so an AVX-512 CPU without BF16 (Skylake-SP, Ice Lake)
    would have loaded it and died of SIGILL; the module and the saved artifact now name
    what is missing."""
    layer = mhagen.mha(64, 4, dtype="bfloat16")
    m = mhagen.build(layer, "x86-avx512-bf16", batch=1, seq_len=8,
                     weights=layer.init_weights(0), tuning=None)
    assert "vdpbf16ps" in m.inspect("source")
    assert {"avx512bf16", "avx512vnni"} <= set(m.target.required_features())
    path = m.save(tmp_path / "bf16")
    skylake_sp = resolve("x86-avx512").required_features()
    monkeypatch.setattr("mhagen.host.runtime_features", lambda: skylake_sp)
    assert re.search(r"needs CPU features avx512bf16, .*avx512vnni.* that this machine lacks",
                     m.target.cannot_run())
    with pytest.raises(mhagen.ArtifactError, match="needs CPU features avx512bf16, .*avx512vnni"):
        mhagen.load(path)


@pytest.mark.parametrize("hide", [("avx512vbmi2", "gfni"), ("avx512f", "avx512bw", "avx512cd",
                                                             "avx512dq", "avx512vl"),
                                  ("avx2", "fma")])
def test_the_host_preset_leaves_out_what_a_hypervisor_hides(monkeypatch, hide):
    """LLVM names the CPU by family and model (znver4), but a VM may hide some of its
    extensions: `x86` turns those off (-mattr) and its code runs on this machine; hiding
    AVX-512 makes it the AVX2 class."""
    host = resolve("x86")
    hidden = [f for f in hide if f in host.required_features()]
    if not hidden:
        pytest.skip(f"this CPU ({host.cpu}) has none of {', '.join(hide)} to hide")
    have = tuple(f for f in runtime_features() if f not in hidden)
    monkeypatch.setattr("mhagen.host.runtime_features", lambda: have)
    t = resolve("x86")
    assert t.cpu == host.cpu and not set(hidden) & set(t.required_features())
    assert {f"-{f}" for f in hidden} <= set(t.tvm_target_dict()["mattr"])
    assert t.cannot_run() is None
    if "avx512f" in hidden:
        assert t.vector_bits == 256 and t.vector_registers == 16
    layer = mhagen.mha(64, 4, causal=True)
    w = layer.init_weights(0)
    m = mhagen.build(layer, t, batch=1, seq_len=24, weights=w, tuning=None)
    x = _input(1, 24, 64)
    assert_close(m(x), layer.reference(x, w))


@pytest.mark.parametrize("llvm_name", ["k8-sse3", "generic"])
def test_a_cpu_llvm_does_not_know_gets_the_x86_64_level_it_reaches(monkeypatch, llvm_name):
    """LLVM names a CPU it does not know by an older CPU's name or "generic" (qemu -cpu max,
    an AVX2 CPU, was "k8-sse3", and `x86` compiled SSE3 code): the host preset then
    compiles for the best x86-64 level the CPU reaches, plus its other extensions."""
    real = set(runtime_features())
    monkeypatch.setattr("mhagen.target.host_llvm_cpu", lambda: llvm_name)
    avx2 = resolve("x86-avx2").required_features() + ("vaes",)
    avx512 = resolve("x86-avx512").required_features() + ("gfni",)
    for have, cpu, cpu_class in ((avx2, "x86-64-v3", "x86_64-v256-r16"),
                                 (avx512, "x86-64-v4", "x86_64-v512-r32")):
        monkeypatch.setattr("mhagen.host.runtime_features", lambda have=have: have)
        t = resolve("x86")
        assert (t.cpu, t.cpu_class) == (cpu, cpu_class)
        assert sorted(t.required_features()) == sorted(have)     # exactly what the CPU has
        assert resolve("x86-avx2").machine_cpu == cpu    # records: this CPU by that name
        if set(have) <= real:                           # this machine runs that code
            layer = mhagen.mha(64, 4)
            w = layer.init_weights(0)
            m = mhagen.build(layer, t, batch=1, seq_len=24, weights=w, tuning=None)
            x = _input(1, 24, 64)
            assert_close(m(x), layer.reference(x, w))


def test_every_checked_x86_feature_is_one_llvm_knows():
    """The host preset turns features on and off by these names (-mattr); a name this LLVM
    does not know is ignored with a warning (its LLVM dropped Xeon Phi's AVX-512 ER/PF)."""
    import tvm
    from mhagen.host import X86_FEATURES
    x86 = list(X86_FEATURES)
    t = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "x86-64",
                           "mattr": [f"+{f}" for f in x86]})
    known = {str(f) for f in tvm.target.codegen.llvm_get_cpu_features(t)}
    assert set(x86) <= known, sorted(set(x86) - known)


def test_the_c_api_checks_the_class_features_at_create():
    """mha_create refuses a CPU without the artifact's features (MHA_ERR_TARGET) rather than
    running into SIGILL; the generated config lists the class's features."""
    from mhagen.artifact.capi import _cpu_check
    layer = mhagen.mha(64, 4)
    for preset, needed, absent in (("x86-avx512", "avx512f", None),
                                   ("x86-avx2", "avx2", "avx512f")):
        m = mhagen.build(layer, preset, batch=1, seq_len=8, tuning=None)
        check = _cpu_check(module_manifest(m))
        assert f'X("{needed}", ' in check
        assert "fma" in m.target.required_features()
        if absent:
            assert f'"{absent}"' not in check
