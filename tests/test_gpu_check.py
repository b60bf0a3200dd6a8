"""scripts/gpu_check.sh up to the GPU: `prepare` builds a bundle (here, a --quick one), `run`
runs it with a stand-in CUDA driver (tests/data/fake_cuda_driver.c) in a Python that cannot
import mhagen or TVM, as on the GPU machine. The stand-in runs no kernel, so every check must
come out FAILED with the reference's full size as its error: the comparison is real."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mhagen.artifact.files import TENSOR_FILE, read_params_file
from mhagen.ir.graph import Graph
from mhagen.reference import run_reference

from mhagen.schedules.cuda.nvcc import missing_tools

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
MISSING = missing_tools()
pytestmark = pytest.mark.skipif(bool(MISSING) or shutil.which("gcc") is None,
                                reason=f"needs the CUDA toolkit's {', '.join(MISSING)} and gcc")
# a Python that cannot import mhagen or TVM (the GPU machine has neither)
NO_MHAGEN = ("import sys, runpy; sys.modules.update(mhagen=None, tvm=None, tvm_ffi=None); "
             "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu") / "bundle"
    p = subprocess.run([str(SCRIPT), "prepare", str(out), "--quick"], capture_output=True,
                       text=True, env={**os.environ, "PYTHON": sys.executable}, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    return out


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory):
    lib = tmp_path_factory.mktemp("driver") / "libfakecuda.so"
    subprocess.run(["gcc", "-shared", "-fPIC", str(ROOT / "tests/data/fake_cuda_driver.c"),
                    "-o", str(lib)], check=True)
    return lib


def run_step(bundle, *args, **env):
    return subprocess.run([sys.executable, "-c", NO_MHAGEN, str(bundle / "gpu_check.py"),
                           "run", str(bundle), *args], capture_output=True, text=True,
                          env={**os.environ, **{k: str(v) for k, v in env.items()}},
                          cwd=bundle.parent, timeout=300)


def test_bundle_holds_what_the_gpu_machine_runs(bundle):
    meta = json.loads((bundle / "cases.json").read_text())
    assert meta["format"] == "mhagen.gpu_bundle" and meta["preset"] == "cuda-sm90"
    assert {c["kind"] for c in meta["cases"]} == {"check", "bench"}
    assert (bundle / "gpu_check.py").is_file() and os.access(bundle / "gpu_check.sh", os.X_OK)
    size = sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file())
    assert size < 64 << 20
    for case in meta["cases"]:
        art = bundle / case["name"]
        names = {f.name for f in art.iterdir()}
        assert {"kernels.fatbin", "libmha.so", TENSOR_FILE, "manifest.json"} <= names
        assert not names & {"kernel.so", "lib", "tir.txt", "source.txt"}


def test_bundled_reference_is_the_layers_float64_output(bundle):
    """expected.bin is mhagen's float64 reference of the saved weights on x.bin, recomputed
    here from the artifact's own files."""
    meta = json.loads((bundle / "cases.json").read_text())
    for case in (c for c in meta["cases"] if c["kind"] == "check"):
        art = bundle / case["name"]
        man = json.loads((art / "manifest.json").read_text())
        graph = Graph.from_json(man["graph"])
        weights, _ = read_params_file(art / TENSOR_FILE, man["program"]["buffers"],
                                      man["params"], man["weights"])
        x = np.frombuffer((art / "x.bin").read_bytes(), np.float32).reshape(
            case["batch"], case["seq_len"], case["d_model"])
        expected = np.frombuffer((art / "expected.bin").read_bytes(), np.float64)
        lengths = case["lengths"] and np.asarray(case["lengths"], np.int32)
        assert np.array_equal(expected.reshape(case["expected_shape"]),
                              run_reference(graph, x, weights, kv_lens=lengths))
    assert any(c.get("lengths") for c in meta["cases"])     # mha_run_padded is exercised


def test_run_step_reaches_the_gpu_and_compares(bundle, fake_driver, tmp_path):
    log = tmp_path / "driver.log"
    p = run_step(bundle, "--host-only", MHA_CUDA_DRIVER=fake_driver, FAKE_CUDA_LOG=log)
    assert p.returncode == 1, p.stdout + p.stderr      # the stand-in computes nothing
    meta = json.loads((bundle / "cases.json").read_text())
    results = json.loads((bundle / "results.json").read_text())
    checks = [c for c in meta["cases"] if c["kind"] == "check"]
    assert [r["case"] for r in results["checks"]] == [c["name"] for c in checks]
    for case, row in zip(checks, results["checks"]):
        expected = np.frombuffer((bundle / case["name"] / "expected.bin").read_bytes())
        err, allowed = row["host"]
        # y came back as the zeroed device buffer: the error is the reference's largest value
        assert not row["ok"] and err == pytest.approx(np.abs(expected).max(), rel=1e-6)
        assert allowed == case["allowed_error"] < 1e-3
        assert f"FAIL {case['name']}" in p.stdout
    launches = [line.split()[1] for line in log.read_text().splitlines()
                if line.startswith("launch ")]
    # every check case ran its three kernels once (host arrays)
    assert launches == ["qkv_projection_kernel", "attention_kernel",
                        "output_projection_kernel"] * len(checks)
    assert "| small_fp32 | float32 |" in (bundle / "results.md").read_text()


def test_run_step_says_when_there_is_no_gpu(bundle):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    p = run_step(bundle)
    assert p.returncode == 2 and "torch sees no CUDA GPU" in p.stderr
