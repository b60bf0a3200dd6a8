"""CUDA backend, compile-only: no GPU is needed, only the CUDA toolkit (nvcc, ptxas, fatbinary).

Every kernel of the default layer and of a causal grouped-K/V layer is compiled for sm_80 and
sm_90 at build time; ptxas' report shows no register spills and shared memory within the
preset's limit; each program kernel is one GPU kernel (.entry) in the PTX; the attention
kernel stages its tiles in shared memory. Whether the kernels compute the right numbers is
checked where a GPU is (not here).
"""
import re

import numpy as np
import pytest

import mhagen
from mhagen.errors import ArtifactError, ScheduleError, TargetError
from mhagen.target import resolve
from mhagen.weights import init_weights
from tests.conftest import random_input

from mhagen.schedules.cuda.nvcc import missing_tools, parse_ptxas_report, sass

MISSING = missing_tools()
needs_nvcc = pytest.mark.skipif(bool(MISSING), reason="the CUDA toolkit's "
                                f"{', '.join(MISSING)} not on the PATH")

PRESETS = ("cuda-sm80", "cuda-sm90")
LAYERS = {"default": dict(), "causal_gqa": dict(kv_heads=2, causal=True)}
KERNELS = ["qkv_projection", "attention", "output_projection"]


@pytest.fixture(scope="module")
def built():
    cache = {}

    def get(preset, layer):
        if (preset, layer) not in cache:
            cache[preset, layer] = mhagen.build(mhagen.mha(512, 8, **LAYERS[layer]), preset,
                                                batch=1, seq_len=128, tuning=None)
        return cache[preset, layer]
    return get


def test_presets_resolve_without_llvm_queries(monkeypatch):
    import tvm

    def refuse(*args):
        raise AssertionError("a CUDA preset asked LLVM for CPU features")
    monkeypatch.setattr(tvm.target.codegen, "llvm_get_cpu_features", refuse)
    monkeypatch.setattr(tvm.target.codegen, "llvm_get_system_cpu", refuse)
    for preset, arch in (("cuda-sm80", "sm_80"), ("cuda-sm90", "sm_90")):
        t = resolve(preset)
        assert (t.family, t.device, t.features) == ("cuda", "cuda", ())
        assert t.tvm.kind.name == "cuda" and str(t.tvm.attrs["arch"]) == arch
        assert int(t.tvm.attrs["max_shared_memory_per_block"]) == 48 * 1024
        assert t.cpu_class == f"cuda-{arch}"


def test_cuda_target_says_why_it_cannot_run():
    why = resolve("cuda-sm90").cannot_run()
    assert why is not None and "cuda-sm90" in why
    assert "GPU" in why or "not implemented" in why


@needs_nvcc
@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("preset", PRESETS)
def test_every_kernel_compiles_to_device_code(built, preset, layer):
    m = built(preset, layer)
    assert m.program.fusion.startswith("fused")
    assert [k.name for k in m.program.kernels] == KERNELS
    code = m.info.device_code
    sm = preset.removeprefix("cuda-sm")
    assert code.arch == f"sm_{sm}"
    assert re.search(rf"^\.target sm_{sm}\b", code.ptx, re.M)
    # one GPU kernel per program kernel, named after it
    assert sorted(code.entries()) == sorted(f"{k}_kernel" for k in KERNELS)
    assert sorted(code.resources) == sorted(code.entries())
    # a fatbin (magic 0xBA55ED50), holding the cubin ptxas made and the PTX
    assert code.fatbin[:4] == bytes.fromhex("50ed55ba")
    assert len(code.fatbin) > len(code.ptx) // 4


@needs_nvcc
@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("preset", PRESETS)
def test_ptxas_no_spills_and_shared_memory_within_limit(built, preset, layer):
    m = built(preset, layer)
    code = m.info.device_code
    limit = m.target.tvm_target_dict()["max_shared_memory_per_block"]
    for entry, r in code.resources.items():
        assert (r.spill_store_bytes, r.spill_load_bytes) == (0, 0), (entry, r)
        assert r.shared_bytes <= limit, (entry, r)
        assert 0 < r.registers <= 255, (entry, r)
    assert "0 bytes spill stores, 0 bytes spill loads" in code.ptxas_report
    assert code.resources["attention_kernel"].shared_bytes > 0


@needs_nvcc
@pytest.mark.parametrize("preset", PRESETS)
def test_half_gemms_run_on_tensor_cores(preset):
    """A float16 causal grouped-K/V layer: its qkv and att temporaries are float16 on GPUs,
    so dlight tensorizes both GEMMs (fp16 x fp16, fp32 accumulation) into mma.sync and the
    attention runs its tensor-core template (WMMA): every kernel has HMMA instructions in
    its machine code (SASS, by cuobjdump) and spills nothing. A bfloat16 layer compiles too
    (its attention on the float32 template)."""
    m = mhagen.build(mhagen.mha(512, 8, dtype="float16", **LAYERS["causal_gqa"]), preset,
                     batch=1, seq_len=128, tuning=None)
    assert m.program.buffers["qkv"].dtype == m.program.buffers["att"].dtype == "float16"
    entries = dict(e.split("(", 1) for e in re.split(r"\.visible \.entry ",
                                                      m.info.device_code.ptx)[1:])
    for gemm in ("qkv_projection_kernel", "output_projection_kernel"):
        assert "mma.sync.aligned" in entries[gemm], gemm
    assert "wmma.mma.sync.aligned" in entries["attention_kernel"]
    machine = sass(m.info.device_code.fatbin)
    assert sorted(machine) == sorted(entries)
    for entry, code in machine.items():
        assert "HMMA" in code, entry
        r = m.info.device_code.resources[entry]
        assert (r.spill_store_bytes, r.spill_load_bytes) == (0, 0), (entry, r)
    [att] = [d["config"] for d in m.info.decisions if d["kernel"] == "attention"]
    assert att["q_tile"] % 16 == 0 and att["kv_block"] % 16 == 0
    b = mhagen.build(mhagen.mha(512, 8, dtype="bfloat16"), preset, batch=1, seq_len=128,
                     tuning=None)
    assert b.program.buffers["att"].dtype == "bfloat16"


@needs_nvcc
@pytest.mark.parametrize("layer", list(LAYERS))
def test_attention_kernel_uses_shared_memory(built, layer):
    code = built("cuda-sm90", layer).info.device_code
    entries = re.split(r"^\.(?:visible )?\.entry ", code.ptx, flags=re.M)[1:]
    attention = [e for e in entries if e.startswith("attention_kernel(")]
    assert len(attention) == 1
    assert re.search(r"\.shared\b", attention[0])
    assert re.search(r"\bbar\.sync\b|\bbarrier\.sync\b", attention[0])
    assert re.search(r"\bex2\.approx", attention[0])   # the online softmax's exp2


@needs_nvcc
def test_built_module_refuses_calls_and_loads_through_the_driver(built, tmp_path,
                                                                   monkeypatch):
    """A built CUDA module is not callable (TVM's pip runtime has no CUDA); saved, it loads
    through its C API, which needs the CUDA driver (tests/test_cuda_capi.py runs it against
    a stand-in)."""
    m = built("cuda-sm90", "default")
    assert m.cannot_run is not None
    m.bind(init_weights(m.graph, seed=0))   # weights bind (repacked on the host)
    with pytest.raises(TargetError, match="cannot call this module"):
        m(random_input(m.graph, 1, 128))
    m.save(tmp_path / "art")
    monkeypatch.setenv("MHA_CUDA_DRIVER", str(tmp_path / "no-such-driver.so"))
    with pytest.raises(TargetError, match="no CUDA driver"):
        mhagen.load(tmp_path / "art")


@needs_nvcc
def test_unfused_graph_compiles_with_dlight_fallback(tmp_path):
    m = mhagen.build(mhagen.mha(64, 2), "cuda-sm90", batch=1, seq_len=16, fuse=False,
                     tuning=None)
    code = m.info.device_code
    assert not m.program.fusion.startswith("fused")
    assert len(code.entries()) > 1     # one GPU kernel per stage
    assert {d["config"]["rule"] for d in m.info.decisions} == {"dlight.Fallback"}
    for entry, r in code.resources.items():
        assert (r.spill_store_bytes, r.spill_load_bytes) == (0, 0), (entry, r)
    # its intermediates live inside the program kernel: no launch table, so no artifact
    assert code.launches == [] and "no program buffer" in code.launch_problem
    m.bind(init_weights(m.graph, seed=0))
    with pytest.raises(ArtifactError, match="build it fused"):
        m.save(tmp_path / "art")


def test_unbound_stage_is_refused_by_name():
    """An unscheduled TE kernel would compile to host code only; the check names its stages
    and lets the same kernel through once dlight has bound it."""
    from mhagen.lower import lower
    from mhagen.schedules.cuda import BACKEND
    from mhagen.schedules.cuda.verify import check_bound, unbound

    t = resolve("cuda-sm90")
    program = lower(mhagen.mha(64, 2), 1, 16, t)
    gemm = program.kernels[0]
    with pytest.raises(ScheduleError, match=r"qkv_projection.*qkv_matmul.*not bound to GPU"):
        check_bound(gemm, gemm.prim_func, t)
    func, _ = BACKEND.gemm_rule.schedule_whole(gemm, t)
    assert unbound(gemm.prim_func) and not unbound(func)
    check_bound(gemm, func, t)


def test_ptxas_report_parser():
    report = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'attention_kernel' for 'sm_90'
ptxas info    : Function properties for attention_kernel
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 96 registers, used 1 barriers, 45056 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function 'k2' for 'sm_90'
ptxas info    : Function properties for k2
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers, used 0 barriers, 380 bytes cmem[0]
"""
    r = parse_ptxas_report(report)
    a, k = r["attention_kernel"], r["k2"]
    assert (a.registers, a.shared_bytes, a.stack_bytes, a.spill_store_bytes,
            a.spill_load_bytes) == (96, 45056, 8, 4, 12)
    assert (k.registers, k.shared_bytes, k.spill_store_bytes) == (12, 0, 0)


@needs_nvcc
def test_score_modifiers_compile_into_the_attention_kernel():
    layer = mhagen.mha(512, 8, kv_heads=2, causal=True,
                       score_mod=[mhagen.alibi(8), mhagen.softcap(30.0)])
    m = mhagen.build(layer, "cuda-sm90", batch=1, seq_len=128, tuning=None)
    code = m.info.device_code
    kernels = re.split(r'extern "C" __global__', code.source)
    attention = [k for k in kernels if re.search(r"\battention_kernel\(", k) and "{" in k]
    assert len(attention) == 1 and "tanh" in attention[0], "softcap's tanh is in the kernel"
    for entry, r in code.resources.items():
        assert (r.spill_store_bytes, r.spill_load_bytes) == (0, 0), (entry, r)


@needs_nvcc
@pytest.mark.parametrize("variant", ["softcap+alibi", "key_padding", "window", "relative_bias"])
def test_tensor_core_attention_takes_every_score_variant(variant):
    """The float16 (WMMA) attention template with score modifiers, key lengths and a
    sliding window, at head_dim 40 (padded to 48: three fragments) and seq 97 (partial
    tiles): it compiles, runs on tensor cores and its launch reads the table's buffers."""
    options = {"softcap+alibi": dict(score_mod=[mhagen.alibi(4), mhagen.softcap(30.0)]),
               "key_padding": dict(key_padding=True, causal=True),
               "window": dict(mask=mhagen.causal() & (mhagen.q_idx - mhagen.kv_idx < 16)),
               "relative_bias": dict(score_mod=mhagen.relative_bias(
                   np.random.default_rng(0).standard_normal((4, 32))))}[variant]
    m = mhagen.build(mhagen.mha(160, 4, dtype="float16", **options), "cuda-sm90", batch=2,
                     seq_len=97, tuning=None)
    code = m.info.device_code
    assert "HMMA" in sass(code.fatbin)["attention_kernel"]
    [launch] = [la for la in code.launches if la.kernel == "attention"]
    assert set(launch.args) == set(next(k.args for k in m.program.kernels
                                        if k.name == "attention"))
    assert launch.dynamic_shared > 0


@needs_nvcc
def test_relative_bias_table_is_an_attention_argument():
    """T5's bias table reaches the GPU attention kernel as a constant param it reads."""
    table = np.random.default_rng(0).standard_normal((8, 32))
    layer = mhagen.mha(512, 8, causal=True, score_mod=mhagen.relative_bias(table))
    m = mhagen.build(layer, "cuda-sm90", batch=1, seq_len=128, tuning=None)
    attention = next(k for k in m.program.kernels if k.name == "attention")
    assert attention.args == ["qkv", "blocks", "att", "score_table0"]
    assert m.program.buffers["score_table0"].shape == (8 * 257,)
    kernels = re.split(r'extern "C" __global__', m.info.device_code.source)
    body = next(k for k in kernels if re.search(r"\battention_kernel\(", k) and "{" in k)
    assert "score_table0" in body
    for entry, r in m.info.device_code.resources.items():
        assert (r.spill_store_bytes, r.spill_load_bytes) == (0, 0), (entry, r)


@needs_nvcc
def test_key_padding_compiles_with_the_lengths_argument():
    layer = mhagen.mha(512, 8, kv_heads=2, causal=True, key_padding=True)
    m = mhagen.build(layer, "cuda-sm90", batch=2, seq_len=128, tuning=None)
    assert m.program.kernels[1].args == ["qkv", "blocks", "kv_lens", "att"]
    code = m.info.device_code
    assert re.search(r"attention_kernel\([^)]*int\* __restrict__ kv_lens", code.source)
    for entry, r in code.resources.items():
        assert (r.spill_store_bytes, r.spill_load_bytes) == (0, 0), (entry, r)
