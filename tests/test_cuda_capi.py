"""CUDA artifacts and their C API, up to the GPU (none here).

A CUDA artifact holds kernels.fatbin and a launch table instead of kernel.so; its libmha.so
opens the CUDA driver at mha_create and launches the fatbin's kernels itself. Here a fake
driver (tests/data/fake_cuda_driver.c: host memory, launches that run nothing, every call
logged) stands in for libcuda.so.1, and a C program (tests/data/cuda_capi_app.c) uses the API
as an application does: the log shows what the GPU would be asked to do. Whether the kernels
compute the right numbers is scripts/gpu_check.sh's job, on a GPU.
"""
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import mhagen
from mhagen.artifact.describe import describe
from mhagen.errors import ArtifactError, InputError, TargetError
from mhagen.weights import init_weights

from mhagen.schedules.cuda.nvcc import missing_tools

DATA = Path(__file__).parent / "data"
MISSING = missing_tools()
pytestmark = pytest.mark.skipif(bool(MISSING) or shutil.which("gcc") is None,
                                reason=f"needs the CUDA toolkit's {', '.join(MISSING)} and gcc")
LAYERS = {"fp32": (mhagen.mha(64, 2), 40),
          "fp16_causal_gqa": (mhagen.mha(128, 4, kv_heads=2, causal=True, dtype="float16"), 97)}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """name -> artifact directory, the layer's module saved with weights (built once)."""
    root = tmp_path_factory.mktemp("cuda_art")
    out = {}
    for name, (layer, seq) in LAYERS.items():
        m = mhagen.build(layer, "cuda-sm90", batch=2, seq_len=seq, tuning=None,
                         weights=init_weights(layer, seed=0))
        out[name] = m.save(root / name)
    return out


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    """(the fake driver, a function compiling the C app for an artifact)."""
    root = tmp_path_factory.mktemp("cuda_tools")
    driver = root / "libfakecuda.so"
    subprocess.run(["gcc", "-Wall", "-Werror", "-shared", "-fPIC",
                    str(DATA / "fake_cuda_driver.c"), "-o", str(driver)], check=True)

    def app(artifact):
        exe = Path(artifact) / "app"
        subprocess.run(["gcc", "-Wall", "-Werror", str(DATA / "cuda_capi_app.c"), "-I",
                        str(artifact), "-L", str(artifact), "-lmha",
                        f"-Wl,-rpath,{artifact}", "-o", str(exe)], check=True)
        return exe
    return driver, app


def run_app(exe, artifact, tmp_path, **env):
    """Run the C app; returns ({call: (status, message)}, kernel names, the driver's log)."""
    log = tmp_path / "driver.log"
    log.unlink(missing_ok=True)
    full = {**os.environ, "FAKE_CUDA_LOG": str(log), **{k: str(v) for k, v in env.items()}}
    p = subprocess.run([str(exe), str(artifact)], capture_output=True, text=True, env=full,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    calls, kernels = {}, []
    for line in p.stdout.splitlines():
        if line.startswith("kernel "):
            kernels.append(line.split()[2])
        else:
            what, status, *message = line.split(" ", 2)
            calls[what] = (status, message[0] if message else "")
    return calls, kernels, log.read_text().splitlines() if log.exists() else []


def nbytes(buf):
    n = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4}[buf["dtype"]]
    for d in buf["shape"]:
        n *= d
    return n


@pytest.mark.parametrize("name", list(LAYERS))
def test_artifact_holds_the_fatbin_and_a_launch_table(artifacts, name):
    art = artifacts[name]
    man = json.loads((art / "manifest.json").read_text())
    assert (art / "kernels.fatbin").read_bytes()[:4] == bytes.fromhex("50ed55ba")
    assert not (art / "kernel.so").exists() and not (art / "lib").exists()
    assert "kernels.fatbin" in man["files"] and man["c_api"]["runtime_libs"] == []
    code = man["device_code"]
    assert code["arch"] == "sm_90"
    assert [la["kernel"] for la in code["launches"]] == [k["name"] for k in
                                                         man["program"]["kernels"]]
    buffers = {b["name"] for b in man["program"]["buffers"]}
    for la in code["launches"]:
        assert set(la["args"]) <= buffers
        assert la["block"][0] * la["block"][1] * la["block"][2] <= 1024
    text = describe(art)          # mhagen inspect DIR --what manifest
    assert all(f"launch  {la['entry']} grid {la['grid']}" in text for la in code["launches"])
    # libmha.so needs neither TVM nor the CUDA toolkit: only libc, libstdc++ and libdl
    needed = subprocess.run(["readelf", "-d", str(art / "libmha.so")], capture_output=True,
                            text=True).stdout
    libs = re.findall(r"Shared library: \[(.+?)\]", needed)
    assert not [lib for lib in libs if "tvm" in lib or "cuda" in lib], libs


def test_launch_table_matches_tvms_host_code():
    """The grid, block and shared memory the table holds are the values TVM's own host code
    passes to its kernel launches (read independently, from the host function's text)."""
    import importlib

    import tvm
    from tvm import tirx

    from mhagen.compile import resolve_tuning
    from mhagen.lower import lower
    from mhagen.schedules import schedule_kernel
    from mhagen.schedules.cuda.launch import launch_table
    from mhagen.target import resolve
    t = resolve("cuda-sm90")
    layer, seq = LAYERS["fp16_causal_gqa"]
    program = lower(layer, 2, seq, t, fuse=True, tuning=resolve_tuning(None, t), symbolic=None,
                    kv_seq_len=None)
    mod = tvm.IRModule({k.name: schedule_kernel(k, t)[0].with_attr("global_symbol", k.name)
                        for k in program.kernels})
    table = launch_table(mod, t, program)
    bound = tirx.transform.BindTarget(tvm.target.Target(t.tvm, "llvm"))(mod)
    host, _ = importlib.import_module("tvm.tirx.build").split_host_device_mods(
        tirx.get_default_tir_pipeline(t.tvm)[0](bound))
    calls = re.findall(r'call_ffi_kernel\("(\w+)", (.*?), launch_params=\[(.*?)\]',
                       host.script())
    assert sorted(c[0] for c in calls) == sorted(la.entry for la in table)
    for entry, args, params in calls:
        la = next(la for la in table if la.entry == entry)
        names = re.findall(r'"([\w.]+)"', params)
        values = [int(v) for v in re.findall(r"(?:T\.int64\()?(\d+)\)?$",
                                             args.replace(", ", "\n"), re.M)][-len(names):]
        axes = {"blockIdx.x": la.grid[0], "blockIdx.y": la.grid[1], "blockIdx.z": la.grid[2],
                "threadIdx.x": la.block[0], "threadIdx.y": la.block[1],
                "threadIdx.z": la.block[2], "tirx.use_dyn_shared_memory": la.dynamic_shared}
        assert values == [axes[n] for n in names], (entry, args, params)
    assert any(la.dynamic_shared > 48 * 1024 for la in table)   # tensor-core GEMM tiles


@pytest.mark.parametrize("name", list(LAYERS))
def test_c_api_launches_the_kernels_through_the_driver(artifacts, tools, tmp_path, name):
    driver, app = tools
    art = artifacts[name]
    man = json.loads((art / "manifest.json").read_text())
    calls, kernels, log = run_app(app(art), art, tmp_path, MHA_CUDA_DRIVER=driver)
    ok = ("MHA_OK", "")
    assert calls["create"] == ok and calls["run"] == ok and calls["run_device"] == ok
    assert calls["run_kernel_device"] == ok
    assert calls["run_wrong_shape"][0] == "MHA_ERR_SHAPE"
    assert calls["run_kernel_out_of_range"][0] == "MHA_ERR_ARGUMENT"
    assert calls["run_device_null"][0] == "MHA_ERR_NULL_ARGUMENT"
    program = man["program"]
    assert kernels == [k["name"] for k in program["kernels"]]
    size = {b["name"]: nbytes(b) for b in program["buffers"]}
    # every buffer allocated once, every param uploaded whole, all freed at mha_destroy
    allocs = [int(line.split()[1]) for line in log if line.startswith("alloc ")]
    assert sorted(allocs) == sorted(size.values())
    params = [b["name"] for b in program["buffers"] if b["role"] == "param"]
    uploads = [line for line in log if line.startswith("htod ")]
    assert sorted(int(u.split()[1]) for u in uploads[:len(params)]) == \
        sorted(size[p] for p in params)
    assert sorted(int(line.split()[1]) for line in log if line.startswith("free ")) == \
        sorted(allocs)
    assert log[-2:] == ["module unload", "context release 0"]
    # functions with more than 48 KiB of shared memory (static + dynamic) opt in, as the
    # driver requires, for their dynamic part
    table = man["device_code"]["launches"]
    big = {(la["entry"], la["dynamic_shared"]) for la in table
           if la["static_shared"] + la["dynamic_shared"] > 48 * 1024}
    assert bool(big) == (name != "fp32")
    assert {(line.split()[1], int(line.split()[3])) for line in log
            if line.startswith("attribute ")} == big
    # launches: mha_run (legacy stream), mha_run_device (its stream), one kernel alone
    launches = [line.split() for line in log if line.startswith("launch ")]
    assert len(launches) == 2 * len(table) + 1
    x, y = program["kernels"][0]["args"][0], program["kernels"][-1]["args"][-1]
    for i, words in enumerate(launches):
        la = table[i % len(table)] if i < 2 * len(table) else table[1]
        assert words[1] == la["entry"]
        assert [int(v) for v in words[3:6]] == la["grid"]
        assert [int(v) for v in words[7:10]] == la["block"]
        assert int(words[11]) == la["dynamic_shared"]
        assert words[13] == ("0x5eed" if len(table) <= i < 2 * len(table) else "(nil)")
        got = [int(v) for v in words[15:]]
        # device mode: x and y are the caller's pointers (no allocation of the driver's)
        device_mode = i >= len(table)
        want = [-1 if device_mode and a in (x, y) else size[a] for a in la["args"]]
        assert got == want, (words, la)
    # mha_run copies x in and y out: [batch * seq, d] values each
    assert f"dtoh {size[y]} from {size[y]}" in log


def test_c_api_says_why_without_a_gpu(artifacts, tools, tmp_path):
    driver, app = tools
    art = artifacts["fp32"]
    exe = app(art)
    cases = [({"MHA_CUDA_DRIVER": tmp_path / "none.so"}, "no CUDA driver"),
             ({"MHA_CUDA_DRIVER": driver, "FAKE_CUDA_FAIL_INIT": 1}, "cuInit failed"),
             ({"MHA_CUDA_DRIVER": driver, "FAKE_CUDA_DEVICES": 0}, "sees no GPU"),
             ({"MHA_CUDA_DRIVER": driver, "MHA_CUDA_DEVICE": 3}, "GPUs 0..0"),
             ({"MHA_CUDA_DRIVER": driver, "FAKE_CUDA_CC": 80},
              "compute capability 8.0, older than the kernels' sm_90")]
    for env, message in cases:
        calls, _, log = run_app(exe, art, tmp_path, **env)
        status, text = calls["create"]
        assert status == "MHA_ERR_DEVICE" and message in text, (env, text)
        assert not [line for line in log if line.startswith("alloc")]
    # a newer GPU runs sm_90 code (the fatbin's PTX is JIT-compiled for it)
    calls, _, _ = run_app(exe, art, tmp_path, MHA_CUDA_DRIVER=driver, FAKE_CUDA_CC=100)
    assert calls["create"] == ("MHA_OK", "")


def test_c_api_refuses_a_damaged_fatbin(artifacts, tools, tmp_path):
    driver, app = tools
    art = tmp_path / "art"
    shutil.copytree(artifacts["fp32"], art)
    fatbin = art / "kernels.fatbin"
    data = bytearray(fatbin.read_bytes())
    data[len(data) // 2] ^= 0xFF
    fatbin.write_bytes(bytes(data))
    calls, _, log = run_app(app(art), art, tmp_path, MHA_CUDA_DRIVER=driver)
    assert calls["create"][0] == "MHA_ERR_CORRUPT" and "kernels.fatbin" in calls["create"][1]
    assert not [line for line in log if line.startswith("module load")]
    fatbin.unlink()
    calls, _, _ = run_app(app(art), art, tmp_path, MHA_CUDA_DRIVER=driver)
    assert calls["create"][0] == "MHA_ERR_NOT_FOUND"


def test_python_load_runs_the_c_api(artifacts, tools, tmp_path, monkeypatch):
    """mhagen.load of a CUDA artifact: its libmha.so through ctypes (host arrays in and out).
    The stand-in driver computes nothing, so y is the zeroed device buffer copied back; the
    log shows the three launches and the copies."""
    driver, _ = tools
    art = tmp_path / "art"
    shutil.copytree(artifacts["fp16_causal_gqa"], art)     # its own libmha.so instance
    log = tmp_path / "driver.log"
    monkeypatch.setenv("MHA_CUDA_DRIVER", str(driver))
    monkeypatch.setenv("FAKE_CUDA_LOG", str(log))
    m = mhagen.load(art)
    assert m.kernels == ["qkv_projection", "attention", "output_projection"]
    x = np.random.default_rng(0).standard_normal(m.in_shape).astype(np.float32)
    y = m(x)                                   # float32 in: rounded to float16, float32 out
    assert y.shape == m.out_shape and y.dtype == np.float32 and not y.any()
    assert m(x.astype(np.float16)).dtype == np.float16
    launches = [line.split()[1] for line in log.read_text().splitlines()
                if line.startswith("launch ")]
    assert launches == ["qkv_projection_kernel", "attention_kernel",
                        "output_projection_kernel"] * 2
    with pytest.raises(InputError, match="shape"):
        m(x[:, :-1])
    with pytest.raises(InputError, match="key lengths"):
        m(x, kv_lens=np.array([1, 1]))
    m.close()
    assert log.read_text().splitlines()[-1] == "context release 0"
    with pytest.raises(ArtifactError, match="closed"):
        m(x)


def test_a_replaced_artifact_directory_loads_its_new_library(artifacts, tools, tmp_path,
                                                              monkeypatch):
    """dlopen hands back the library already loaded under a name: a directory replaced by
    another artifact and loaded again in the same process must open the new libmha.so
    (the old one, the first artifact's content hash baked in, refused the new manifest)."""
    driver, _ = tools
    monkeypatch.setenv("MHA_CUDA_DRIVER", str(driver))
    art = tmp_path / "art"
    for name, dtype in (("fp16_causal_gqa", np.float16), ("fp32", np.float32)):
        shutil.rmtree(art, ignore_errors=True)
        shutil.copytree(artifacts[name], art)
        m = mhagen.load(art)
        x = np.random.default_rng(0).standard_normal(m.in_shape).astype(dtype)
        assert m(x).dtype == dtype and m.graph.dtype == np.dtype(dtype).name
        m.close()


def test_python_load_says_there_is_no_gpu(artifacts, tmp_path, monkeypatch):
    art = tmp_path / "art"
    shutil.copytree(artifacts["fp32"], art)
    monkeypatch.setenv("MHA_CUDA_DRIVER", str(tmp_path / "no-driver.so"))
    with pytest.raises(TargetError, match="no CUDA driver"):
        mhagen.load(art)
    (art / "libmha.so").unlink()
    with pytest.raises(ArtifactError, match="checksum|missing|C API"):
        mhagen.load(art)


def test_driver_declarations_match_cuda_h(tmp_path):
    """mha_cuda_driver.h declares the driver's types and constants itself (libmha.so builds
    without the toolkit); they must be cuda.h's."""
    nvcc = Path(shutil.which("nvcc")).resolve()
    includes = [p for p in (nvcc.parent.parent / "include", Path("/usr/local/cuda/include"),
                            *Path("/usr/local").glob("cuda-*/include"))
                if (p / "cuda.h").is_file()]
    if not includes:
        pytest.skip("the CUDA toolkit's cuda.h is not installed")
    runtime = Path(mhagen.__file__).parent / "artifact" / "runtime"
    header = (runtime / "mha_cuda_driver.h").read_text()
    functions = re.findall(r'X\((\w+), "(\w+)"', header)
    assert len(functions) >= 15
    checks = "\n".join(f"static_assert(same_shape<cu::Driver::{field}Fn, decltype({symbol})>"
                       f"::value, \"{symbol}\");" for field, symbol in functions)
    src = tmp_path / "check.cc"
    src.write_text("""
#include <cuda.h>
#include "mha_cuda_driver.h"
namespace cu = mha::cu;
static_assert(cu::kAttrComputeCapabilityMajor == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
static_assert(cu::kAttrComputeCapabilityMinor == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
static_assert(cu::kAttrMaxSharedPerBlockOptin ==
              CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN);
static_assert(cu::kFuncAttrMaxDynamicShared == CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES);
static_assert(cu::kSuccess == CUDA_SUCCESS);
static_assert(sizeof(cu::DevicePtr) == sizeof(CUdeviceptr));
// each function: as many parameters as cuda.h's declaration of the exported symbol, each of
// the same size (the handle types are distinct structs, the enums ints)
template <typename A, typename B> struct same_shape { static constexpr bool value = false; };
template <typename R1, typename... A1, typename R2, typename... A2>
struct same_shape<R1(A1...), R2(A2...)> {
  static constexpr bool value = sizeof(R1) == sizeof(R2) && sizeof...(A1) == sizeof...(A2) &&
                                ((sizeof(A1) == sizeof(A2)) && ...);
};
""" + checks + "\nint main() { return 0; }\n")
    p = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", f"-I{includes[0]}",
                        f"-I{runtime}", str(src)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
