"""ARM (aarch64) targets, built on this x86 machine: presets and rules, cross-compiled kernels
checked instruction by instruction (NEON fmla on v registers, SVE on z registers), and run
under qemu-user through the generated C API and the same C example app as on x86
(examples/c_app/mha_app.c) against the float64 reference.

Needs the cross toolchain and qemu (.ci/setup-arm.sh installs them) and TVM's aarch64 runtime
(fetched from PyPI into mhagen's cache on first use). Without them these tests skip with the
reason, or fail with the install hint when the CI environment variable is set.
"""
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import mhagen
from mhagen.artifact import other_arch
from mhagen.errors import ArtifactError, TargetError
from mhagen.target import host_arch, resolve
from mhagen.tolerances import assert_close, max_error
from tests.conftest import decoding_reference, random_input, unavailable

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "examples" / "c_app" / "mha_app.c"
EM_AARCH64 = 183
PACKAGES = ("gcc-aarch64-linux-gnu", "g++-aarch64-linux-gnu", "libc6-dev-arm64-cross")

LAYERS = {
    # id: (mha kwargs, batch, seq_len)
    "default-512x8": (dict(d_model=512, num_heads=8), 1, 32),
    "causal-gqa-256x8-kv2": (dict(d_model=256, num_heads=8, kv_heads=2, causal=True), 1, 32),
    # half-precision storage (float32 compute): fcvtl/fcvtn conversions, bfloat16 shifts
    "f16-causal-gqa-128x4-kv2": (dict(d_model=128, num_heads=4, kv_heads=2, causal=True,
                                      dtype="float16"), 1, 32),
    "bf16-causal-128x4": (dict(d_model=128, num_heads=4, causal=True, dtype="bfloat16"), 1, 32),
    # T5's relative bias: its table reaches the kernel as a param (params.bin, the C API)
    "t5-bias-128x4": (dict(d_model=128, num_heads=4, causal=True, score_mod=mhagen.relative_bias(
        np.linspace(-1.0, 1.0, 4 * 8).reshape(4, 8), max_distance=12)), 1, 32),
    # ALiBi then softcap in the score write-back (slopes per head, the vectorised tanh)
    "alibi-softcap-128x4": (dict(d_model=128, num_heads=4, causal=True,
                                 score_mod=[mhagen.alibi(4), mhagen.softcap(2.0)]), 1, 32),
}
RUN_TARGETS = ("arm-neon", "arm-sve")

pytestmark = pytest.mark.skipif(host_arch() == "aarch64",
                                reason="these tests cross-build from another architecture")


@pytest.fixture(scope="module")
def toolchain():
    a = other_arch.arch_info("aarch64")
    missing = [t for t in (a.cc, a.cxx, a.objdump) if shutil.which(t) is None]
    if missing:
        unavailable(f"{', '.join(missing)} not installed; {other_arch.install_hint('aarch64')}")
    return a


@pytest.fixture(scope="module")
def qemu(toolchain):
    try:
        return other_arch.require_emulator("aarch64")
    except TargetError as err:
        unavailable(str(err))


@pytest.fixture(scope="module")
def aarch64_runtime(toolchain):
    """TVM's aarch64 runtime in mhagen's cache (downloaded once, ~100 MB, 6 MB kept)."""
    try:
        return other_arch.fetch_runtime("aarch64")
    except TargetError as err:
        unavailable(f"TVM's aarch64 runtime could not be fetched: {err}")


class Artifact:
    """One layer cross-built for one ARM target and saved with its C API; the C example app
    cross-compiled against it."""

    def __init__(self, module, layer, w, x, name):
        """Save module as directory `name` with x (stored in the module's dtype) beside it
        as name.x.bin, and keep its reference output."""
        self.layer, self.w, self.module = layer, w, module
        self.batch, self.seq_len = x.shape[:2]
        self.dir = module.save(name)
        self.manifest = json.loads((self.dir / "manifest.json").read_text())
        self.dtype = module.dtype
        self.x = x.astype(self.dtype)
        self.expected = layer.reference(self.x, w)
        self.xfile = name.parent / f"{name.name}.x.bin"
        self.x.tofile(self.xfile)
        self._app = None

    @classmethod
    def of_layer(cls, target, key, root):
        """The LAYERS entry `key` built for `target`."""
        kwargs, batch, seq_len = LAYERS[key]
        layer = mhagen.mha(**kwargs)
        w = layer.init_weights(seed=3)
        module = mhagen.build(layer, target, batch=batch, seq_len=seq_len, weights=w)
        return cls(module, layer, w, random_input(layer, batch, seq_len, seed=5),
                   root / f"{target}-{key}")

    @property
    def app(self):
        if self._app is None:
            self._app = other_arch.compile_app(APP, self.dir,
                                               self.dir.parent / f"{self.dir.name}.app")
        return self._app

    def cpu(self):
        t = self.manifest["target"]
        return other_arch.qemu_cpu(t["tvm"]["mcpu"], t["features"], t["vector_bits"])

    def run(self, cpu=None):
        """Run the app under qemu; returns (completed process, y or None)."""
        out = self.dir.parent / f"{self.dir.name}.y.bin"
        if out.exists():
            out.unlink()
        r = other_arch.run([self.app, self.dir, self.xfile, out], cpu=cpu or self.cpu(),
                           timeout=600)
        y = np.fromfile(out, self.dtype).reshape(self.expected.shape) if out.exists() else None
        return r, y


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, toolchain, aarch64_runtime):
    root = tmp_path_factory.mktemp("arm")
    cache = {}

    def get(target, key):
        if (target, key) not in cache:
            cache[target, key] = Artifact.of_layer(target, key, root)
        return cache[target, key]
    return get


def _elf_machine(path) -> int:
    with open(path, "rb") as f:
        head = f.read(20)
    assert head[:4] == b"\x7fELF", f"{path} is not an ELF file"
    return int.from_bytes(head[18:20], "little")


# -- presets and rules (no toolchain needed) -------------------------------------------------
@pytest.mark.parametrize("name, lanes, features", [
    ("arm-neon", 4, ("neon",)), ("arm-sve", 8, ("neon", "sve")), ("arm-a72", 4, ("neon",))])
def test_arm_presets_resolve_as_data(name, lanes, features):
    t = resolve(name)
    assert t.arch == "aarch64" and t.lanes == lanes and t.vector_registers == 32
    assert isinstance(t.cores, int) and t.cores >= 1
    assert t.cross_compiler == "aarch64-linux-gnu-g++"
    assert t.required_features() == features
    assert t.tvm_target_dict()["mtriple"] == "aarch64-linux-gnu"
    assert not t.runs_here()


def test_arm_rules_are_the_cpu_rules_read_through_target_attributes():
    from mhagen.backends import Backend
    from mhagen.schedules.cpu.backend import RULES as CPU
    from mhagen.schedules.cpu.attention import register_tiles
    from mhagen.schedules.cpu.matmul import MatmulConfig
    from mhagen.workloads import GemmWorkload
    neon, sve = resolve("arm-neon"), resolve("arm-sve")
    backend = Backend.for_target(neon)
    assert backend.family == "cpu-arm" and backend.device == "cpu"
    assert [type(r) for r in backend.rules] == [type(r) for r in CPU]
    assert backend.attention is not None
    matmul = next(r for r in backend.rules if r.name == "matmul")
    # register tiles sized from lanes and the 32 vector registers (4 kept for operands)
    for target, panel in ((neon, 8), (sve, 16)):
        workload = GemmWorkload(rows=0, cols=0, depth=1, panel=panel)
        assert matmul.default_config(workload, target) == MatmulConfig(8, panel)
    # (S^T keys x queries, P V queries x head columns) for head_dim 64 and the GEMM panel
    assert register_tiles(neon, 64, 8) == (8, 8, 8, 8)
    assert register_tiles(sve, 64, 16) == (8, 16, 8, 16)


def test_building_without_the_cross_compiler_names_the_packages(tmp_path, monkeypatch):
    layer = mhagen.mha(64, 4)
    module = mhagen.build(layer, "arm-neon", batch=1, seq_len=8, weights=layer.init_weights(0))
    assert "fmla" in module.inspect("source")   # compiling needs no cross toolchain...
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(TargetError, match="aarch64-linux-gnu-g\\+\\+") as err:
        module.save(tmp_path / "m")          # ...linking kernel.so does
    for package in PACKAGES:
        assert package in str(err.value)
    assert not (tmp_path / "m").exists(), "nothing is written when the compiler is missing"


def test_cli_build_without_the_cross_compiler_is_one_line(tmp_path, monkeypatch, capsys):
    from mhagen.cli import main
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    rc = main(["build", "--target", "arm-neon", "--d-model", "64", "--heads", "4",
               "--seq-len", "8", "--out", str(tmp_path / "m")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("mhagen build: error: building for arm-neon")
    assert "sudo apt-get install -y gcc-aarch64-linux-gnu" in err


def test_arm_module_cannot_be_called_here():
    layer = mhagen.mha(64, 4)
    module = mhagen.build(layer, "arm-neon", batch=1, seq_len=8, weights=layer.init_weights(0))
    with pytest.raises(TargetError, match="cannot call this module: .* is aarch64 code"):
        module(random_input(layer, 1, 8))


def test_tuning_for_arm_needs_a_device(tmp_path):
    with pytest.raises(TargetError, match="--rpc-tracker HOST:PORT --device-key"):
        mhagen.tune(mhagen.mha(64, 4), "arm-a72", shapes=[(1, 8)], trials=1,
                    database=tmp_path / "db.json", progress=False)


# -- cross-compiled code ---------------------------------------------------------------------
@pytest.mark.parametrize("target", ["arm-neon", "arm-sve"])
def test_disassembly_shows_neon_or_sve(artifacts, target):
    art = artifacts(target, "default-512x8")
    assert _elf_machine(art.dir / "kernel.so") == EM_AARCH64
    text = other_arch.disassemble(art.dir / "kernel.so")
    assert "file format elf64-littleaarch64" in text
    neon_fmla = len([ln for ln in text.splitlines() if "\tfmla\tv" in ln and ".4s" in ln])
    sve_fmla = len([ln for ln in text.splitlines() if "\tfmla\tz" in ln])
    z_regs = len(re.findall(r"[\s,{]z\d+\b", text))
    if target == "arm-neon":
        assert neon_fmla > 50 and sve_fmla == 0 and z_regs == 0
    else:  # fixed-length SVE: predicated fmla/ld1w/st1w on z registers, 256-bit (vl8) ptrue
        assert sve_fmla > 50 and neon_fmla == 0
        assert "\tld1w\t{z" in text and "\tst1w\t{z" in text and "ptrue\tp0.s, vl8" in text


def test_a72_preset_builds_neon(tmp_path, toolchain):
    layer = mhagen.mha(128, 4)
    module = mhagen.build(layer, "arm-a72", batch=1, seq_len=16, weights=layer.init_weights(0))
    d = module.save(tmp_path / "a72")
    text = other_arch.disassemble(d / "kernel.so")
    assert "\tfmla\tv" in text and "\tfmla\tz" not in text
    man = json.loads((d / "manifest.json").read_text())
    assert man["target"]["tvm"]["mcpu"] == "cortex-a72" and man["target"]["arch"] == "aarch64"


def test_artifact_carries_an_aarch64_c_api(artifacts):
    art = artifacts("arm-neon", "default-512x8")
    for name in ("libmha.so", "lib/libtvm_ffi.so", "lib/libtvm_runtime.so"):
        assert _elf_machine(art.dir / name) == EM_AARCH64, name
    c_api = art.manifest["c_api"]
    assert "aarch64-linux-gnu-g++" in c_api["compiler"] and "skipped" not in c_api
    assert "aarch64" in (art.dir / "mha.h").read_text()


# every float32 layer on both targets; each half-precision layer on one (CI time)
RUNS = [(t, k) for t in RUN_TARGETS for k in LAYERS if LAYERS[k][0].get("dtype") is None] + [
    ("arm-neon", "f16-causal-gqa-128x4-kv2"), ("arm-sve", "bf16-causal-128x4")]


@pytest.mark.parametrize("target, key", RUNS)
def test_runs_under_qemu_and_matches_the_reference(artifacts, qemu, target, key):
    art = artifacts(target, key)
    r, y = art.run()
    assert r.returncode == 0, f"qemu -cpu {art.cpu()}: {r.stderr}"
    assert "y: [" in r.stdout
    if art.layer.dtype == "float32":
        assert max_error(y, art.expected) < 1e-4
    assert_close(y, art.expected, art.layer.dtype)


def test_sve_code_runs_on_wider_sve_vectors(artifacts, qemu):
    """Fixed-length 256-bit SVE uses predicated (vl8) operations: correct on 512-bit SVE too."""
    art = artifacts("arm-sve", "default-512x8")
    r, y = art.run(cpu="max,sve512=on")
    assert r.returncode == 0, r.stderr
    assert max_error(y, art.expected) < 1e-4


@pytest.mark.parametrize("key", ["f16-causal-gqa-128x4-kv2", "bf16-causal-128x4"])
def test_neon_half_precision_code_runs_without_fp16_arithmetic(artifacts, qemu, key):
    """arm-neon code is compiled for a Neoverse N1 (FP16 arithmetic, BF16 absent) and needs
    only NEON (mhagen.host.RUNTIME_FEATURES): its half-precision layers convert with base
    NEON (fcvtl/fcvtn, shifts), so they run on a Cortex-A72 (ARMv8.0, no FP16)."""
    art = artifacts("arm-neon", key)
    assert art.manifest["target"]["features"] == ["neon"]
    r, y = art.run(cpu="cortex-a72")
    assert r.returncode == 0, r.stderr
    assert_close(y, art.expected, art.layer.dtype)


@pytest.mark.parametrize("cpu, why", [("neoverse-n1", "lacks sve "),
                                      ("max,sve128=on", "sve with 256-bit vectors")])
def test_sve_artifact_refuses_a_cpu_without_256_bit_sve(artifacts, qemu, cpu, why):
    art = artifacts("arm-sve", "default-512x8")
    r, y = art.run(cpu=cpu)
    assert r.returncode == 1 and y is None
    assert "MHA_ERR_TARGET" in r.stderr and why in r.stderr, r.stderr


def test_loading_an_aarch64_module_here_is_a_clear_error(artifacts):
    art = artifacts("arm-neon", "causal-gqa-256x8-kv2")
    with pytest.raises(ArtifactError, match=r"aarch64 code.* run it on a aarch64 machine"):
        mhagen.load(art.dir)


def test_c_api_skipped_with_a_note_when_the_runtime_is_not_cached(tmp_path, monkeypatch,
                                                                 toolchain):
    monkeypatch.setenv("MHAGEN_CACHE", str(tmp_path / "empty-cache"))
    layer = mhagen.mha(64, 4)
    module = mhagen.build(layer, "arm-neon", batch=1, seq_len=8, weights=layer.init_weights(0))
    d = module.save(tmp_path / "m")
    man = json.loads((d / "manifest.json").read_text())
    assert "python -m mhagen.artifact.other_arch fetch aarch64" in man["c_api"]["skipped"]
    assert _elf_machine(d / "kernel.so") == EM_AARCH64 and not (d / "libmha.so").exists()


def test_tuning_builder_links_arm_candidates_with_the_cross_compiler(toolchain):
    import tvm
    import tvm.s_tir.meta_schedule as ms

    from mhagen.lower import lower
    from mhagen.records.database import Tuning
    from mhagen.tuning.search import _local_builder
    t = resolve("arm-a72")
    program = lower(mhagen.mha(64, 4), 1, 8, t, tuning=Tuning.none())
    kernel = next(k for k in program.kernels if k.name == "qkv_projection")
    (res,) = _local_builder(t.tvm, max_workers=1).build(
        [ms.builder.BuilderInput(tvm.IRModule({"main": kernel.prim_func}), t.tvm)])
    assert res.error_msg is None, res.error_msg
    assert res.artifact_path.endswith(".so") and _elf_machine(res.artifact_path) == EM_AARCH64
    shutil.rmtree(os.path.dirname(res.artifact_path), ignore_errors=True)


def test_every_backend_names_its_own_attention_and_gemm_rules():
    """Backends name their rules, not list positions (a new rule once shifted them)."""
    from mhagen.backends import Backend
    from mhagen.schedules.cpu.attention import AttentionRule
    from mhagen.schedules.cpu.matmul import MatmulRule
    for preset in ("x86-avx2", "arm-neon"):
        backend = Backend.for_target(resolve(preset))
        assert isinstance(backend.attention, AttentionRule)
        assert isinstance(backend.gemm_rule, MatmulRule)
    cuda = Backend.for_target(resolve("cuda-sm90"))
    assert cuda.attention.name == "attention" and hasattr(cuda.gemm_rule, "schedule_whole")


@pytest.mark.parametrize("target,cache_dtype", [(t, "float32") for t in RUN_TARGETS] +
                         [("arm-neon", "bfloat16")])
def test_decoding_under_qemu_matches_the_whole_sequence(tmp_path, qemu, aarch64_runtime,
                                                        target, cache_dtype):
    """A decoding layer (cache append + split-KV template) cross-built for NEON / SVE with
    symbolic lengths (any number of new tokens per call), examples/c_app/decode.c
    cross-compiled against it, under qemu: a prompt of 9 tokens in one call, then 12 single
    tokens; the causal layer on all 21 tokens (a bfloat16 cache: the reference fed the same
    calls, its rows rounded as the layer says)."""
    kw = dict(kv_heads=2, causal=True, rotary=True)
    layer = mhagen.mha(96, 4, kv_cache=32, cache_dtype=cache_dtype, **kw)   # head_dim 24
    w = layer.init_weights(1)
    module = mhagen.build(layer, target, batch=1, seq_len=None, max_seq_len=16, weights=w)
    d = module.save(tmp_path / "step")
    app = other_arch.compile_app(APP.parent / "decode.c", d, tmp_path / "decode.app")
    x = random_input(layer, 1, 21, seed=2)
    x.tofile(tmp_path / "x.f32")
    t = json.loads((d / "manifest.json").read_text())["target"]
    r = other_arch.run([app, d, tmp_path / "x.f32", 21, tmp_path / "y.f32", 9],
                       cpu=other_arch.qemu_cpu(t["tvm"]["mcpu"], t["features"],
                                               t["vector_bits"]),
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "21 tokens in 13 calls" in r.stdout and "the cache holds 21 of 32" in r.stdout
    y = np.fromfile(tmp_path / "y.f32", np.float32).reshape(x.shape)
    assert_close(y, *decoding_reference(layer, mhagen.mha(96, 4, **kw), w, x, [9] + [1] * 12))
