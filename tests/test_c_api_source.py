"""The C API's runtime as C++ source (mhagen/artifact/runtime/): the compiler as linter on it with
the config generated from a real artifact (tests/data/artifact-v3), the status codes written
from one table, the generated config holding data only, and the toolchain modules' layering."""
import ast
import json
import re
import shutil
import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

from mhagen.artifact import capi, other_arch, toolchain, tvm_runtime
from mhagen.errors import ArtifactError

ROOT = Path(__file__).resolve().parents[1]
V3 = ROOT / "tests" / "data" / "artifact-v3"   # the format the C API is generated for
LINT = ["-std=c++17", "-Wall", "-Wextra", "-Wpedantic", "-Wshadow", "-Werror", "-fsyntax-only"]
STATUS_NAMES = [name for name, _, _ in capi.STATUS]


@pytest.fixture
def artifact(tmp_path):
    """A copy of the small test artifact (x86-avx2, no C API) and its manifest."""
    d = Path(shutil.copytree(V3, tmp_path / "a"))
    return d, json.loads((d / "manifest.json").read_text())


def _include_dir():
    found = capi.find_tvm_runtime()
    if isinstance(found, str):
        pytest.skip(found)
    return found[0]


def _lint(cxx, directory, *defines):
    """Compile mha_runtime.cc with the artifact's generated headers, warnings as errors."""
    if shutil.which(cxx) is None:
        pytest.skip(f"needs {cxx}")
    cmd = [cxx, *LINT, *defines, f"-I{directory}", "-isystem", str(_include_dir()),
           str(directory / capi.SOURCE)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, " ".join(cmd) + "\n" + r.stderr


def test_runtime_compiles_without_warnings(artifact):
    d, man = artifact
    assert capi.write_sources(d, man) == ["mha.h", "mha_config.h", "mha_runtime.h",
                                          "mha_runtime.cc", "mha_cpu.h",
                                          "mha_cuda_driver.h"]
    assert "#define MHA_DEVICE_CUDA 0" in (d / capi.CONFIG).read_text()
    _lint("g++", d, "-DMHA_IMPL=1")   # lib/libmha_impl.so, the runtime proper
    # libmha.so, the loader: it reads the table of lib/ written after the runtime is built
    (d / "lib").mkdir()
    for name in [*capi.RUNTIME_LIBS, Path(capi.RUNTIME_LIBRARY).name]:
        (d / "lib" / name).write_bytes(name.encode())
    header = capi.generate_libraries_header(d)
    (d / capi.LIBRARIES_HEADER).write_text(header)
    rows = re.findall(r'\{"(lib/[^"]+)", (\d+), "[0-9a-f]{64}"\}', header)
    assert rows == [("lib/libtvm_ffi.so", "13"), ("lib/libtvm_runtime.so", "17"),
                    ("lib/libmha_impl.so", "14")]
    _lint("g++", d, "-DMHA_LOADER=1")


def test_cuda_runtime_compiles_without_warnings(artifact):
    """The CUDA branch (the driver opened at run time, kernels.fatbin, the launch table), with
    the same program turned into a CUDA artifact's manifest."""
    d, man = artifact
    man["target"]["device"] = "cuda"
    (d / "kernels.fatbin").write_bytes(bytes.fromhex("50ed55ba") + bytes(60))
    man["files"]["kernels.fatbin"] = man["files"].pop("kernel.so")
    man["device_code"] = {"arch": "sm_90", "launches": [
        {"kernel": k["name"], "entry": f"{k['name']}_kernel", "grid": [4, 2, 1],
         "block": [128, 1, 1], "dynamic_shared": 65536 * i, "args": k["args"]}
        for i, k in enumerate(man["program"]["kernels"])]}
    capi.write_sources(d, man)
    config = (d / capi.CONFIG).read_text()
    assert "#define MHA_DEVICE_CUDA 1" in config and "kDLCUDA" in config
    assert "constexpr int kComputeCapability = 90;" in config
    assert re.search(r'\{"attention_kernel", \{4, 2, 1\}, \{128, 1, 1\}, 65536, 0, 3, ', config)
    header = (d / capi.HEADER).read_text()
    assert "MHA_API int mha_run_device(" in header and "libcuda.so.1" in header
    _lint("g++", d)


@pytest.mark.parametrize("features", [[], ["neon"], ["neon", "sve"]])
def test_runtime_compiles_for_aarch64_without_warnings(artifact, features):
    """The aarch64 branch (AT_HWCAP bits, the SVE vector length) with and without features;
    the tvm-ffi headers are the same for every architecture."""
    d, man = artifact
    man["target"].update(arch="aarch64", features=features, vector_bits=256)
    capi.write_sources(d, man)
    config = (d / capi.CONFIG).read_text()
    assert ('X("sve", 22)' in config) == ("sve" in features)
    assert f"MHA_SVE_VECTOR_BITS {256 if 'sve' in features else 0}" in config
    _lint(other_arch.arch_info("aarch64").cxx, d, "-DMHA_IMPL=1")


def test_status_enum_and_names_come_from_STATUS(artifact):
    d, man = artifact
    header = capi.generate_header(man)
    enum = re.search(r"typedef enum mha_status \{(.*?)\} mha_status;", header, re.S).group(1)
    assert [(n, int(v)) for n, v in re.findall(r"(MHA_\w+) = (\d+),", enum)] == \
        [(n, v) for n, v, _ in capi.STATUS]
    for name, _, meaning in capi.STATUS:
        assert meaning[:30] in " ".join(enum.split()), name
    config = capi.generate_config(man, capi._file_table(d, man))
    status_list = re.search(r"#define MHA_STATUS_LIST\(X\)(.*?)\n\n", config, re.S).group(1)
    assert re.findall(r"X\((\w+)\)", status_list) == STATUS_NAMES


def _code_only(source: str) -> str:
    """C++ source without comments, character and string literals."""
    source = re.sub(r"//[^\n]*", "", source)
    source = re.sub(r"'(\\.|[^'\\])'", "''", source)
    return re.sub(r'"(\\.|[^"\\])*"', '""', source)


def test_runtime_uses_only_statuses_of_STATUS_by_name():
    code = _code_only((capi.RUNTIME_DIR / "mha_runtime.cc").read_text())
    used = set(re.findall(r"\bMHA_(?:OK|ERR_\w+)\b", code))
    assert {"MHA_OK", "MHA_ERR_CORRUPT", "MHA_ERR_SHAPE"} <= used <= set(STATUS_NAMES)
    assert not re.search(r"\bfail\(\s*\d", code)          # never a bare number
    assert not re.search(r"\bMHA_\w+\s*=", code)           # nor a status defined here


def test_generated_config_is_data_and_hashes_only_what_the_runtime_reads(artifact):
    d, man = artifact
    config = capi.generate_config(man, capi._file_table(d, man))
    assert not re.search(r"\)\s*(const\s*)?\{", _code_only(config))   # no function bodies
    assert man["files"]["kernel.so"] in config
    size = (d / "weights.safetensors").stat().st_size
    assert f'{{"weights.safetensors", {size}, "{man["files"]["weights.safetensors"]}"}}' in \
        config
    assert "kDeviceType = kDLCPU" in config
    # the CPU features as CPUID bits (leaf, subleaf, register, bit, XCR0 state)
    assert 'X("avx2", 0x7, 0, 1, 5, 0x6)' in config and 'X("fma", 0x1, 0, 2, 12, 0x6)' in config


def test_runtime_never_reads_a_checked_file_whole():
    """kernel.so and weights.safetensors are hashed in chunks (params copied into their buffers
    on the way); only manifest.json and a CUDA artifact's kernels.fatbin (checked first, then handed
    to the driver from memory), both bounded, are read whole."""
    code = (capi.RUNTIME_DIR / "mha_runtime.cc").read_text()
    assert "std::vector<uint8_t> chunk(size_t(1) << 20)" in code
    # its definition, the manifest, the fatbin
    assert code.count("read_small_file(") == 3


def test_an_unknown_device_is_refused(artifact):
    d, man = artifact
    man["target"]["device"] = "metal"
    with pytest.raises(ArtifactError, match="'metal'"):
        capi.generate_config(man, capi._file_table(d, man))


def test_runtime_sources_are_package_data():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = data["package-data"]["mhagen.artifact"]
    for name in capi.RUNTIME_SOURCES:
        assert (capi.RUNTIME_DIR / name).is_file()
        assert any(fnmatch(f"runtime/{name}", p) for p in patterns), name


def test_toolchain_layering():
    """tvm_runtime (leaf) <- other_arch <- toolchain <- capi: each imports alone, the runtime
    library list is defined once, and none imports another mhagen module inside a function."""
    for mod in ("mhagen.artifact.tvm_runtime", "mhagen.artifact.other_arch",
                "mhagen.artifact.toolchain", "mhagen.artifact.capi"):
        r = subprocess.run([sys.executable, "-c", f"import {mod}"], capture_output=True,
                           text=True, cwd=ROOT)
        assert r.returncode == 0, r.stderr
    assert other_arch.RUNTIME_LIBS is tvm_runtime.RUNTIME_LIBS is capi.RUNTIME_LIBS
    assert capi.Toolchain is toolchain.Toolchain
    for mod in (capi, other_arch, toolchain, tvm_runtime):
        tree = ast.parse(Path(mod.__file__).read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, ast.ImportFrom):
                        assert not (node.module or "").startswith("mhagen"), \
                            f"{mod.__name__}.{fn.name} imports {node.module}"
                    elif isinstance(node, ast.Import):
                        assert not any(a.name.startswith("mhagen") for a in node.names)
