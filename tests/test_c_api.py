"""The artifact directory and its generated C API: the C and C++ example apps against the
reference, and every error path of mha_create/mha_run (through a small C driver)."""
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import mhagen
from mhagen.artifact.describe import describe
from mhagen.artifact.manifest import content_hash
from mhagen.tolerances import assert_close, max_error
from tests.conftest import build_c_app, decoding_reference, random_input

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "examples" / "c_app"
CC, CXX = shutil.which("gcc") or shutil.which("cc"), shutil.which("g++") or shutil.which("c++")
pytestmark = pytest.mark.skipif(not (CC and CXX), reason="needs gcc and g++")

ARTIFACTS = {
    # id: (mha kwargs, batch, seq_len, fuse)
    "small-causal": (dict(d_model=64, num_heads=4, causal=True), 2, 17, True),
    "default-512x8": (dict(d_model=512, num_heads=8), 1, 32, True),
    "padded-out-d40": (dict(d_model=40, num_heads=4), 2, 5, True),   # out [10, 64]: y = out[:, :40]
    "unfused-d40": (dict(d_model=40, num_heads=4), 2, 5, False),     # x, out [batch, seq, d]
    # four kernels (the rotary pass between the QKV GEMM and attention), a score modifier
    "rope-alibi-gqa": (dict(d_model=64, num_heads=4, kv_heads=2, causal=True, rotary=True,
                            score_mod=mhagen.alibi(4)), 2, 17, True),
}


class Artifact:
    def __init__(self, key, root):
        kwargs, self.batch, self.seq_len, fuse = ARTIFACTS[key]
        self.layer = mhagen.mha(**kwargs)
        self.w = self.layer.init_weights(seed=3)
        module = mhagen.build(self.layer, "x86", batch=self.batch, seq_len=self.seq_len,
                              weights=self.w, fuse=fuse)
        self.dir = module.save(root / key)
        self.x = random_input(self.layer, self.batch, self.seq_len, seed=5)
        self.expected = self.layer.reference(self.x, self.w)
        self.xfile = root / f"{key}.x.f32"
        self.x.tofile(self.xfile)
        self._apps = {}

    def app(self, kind="c"):
        """The example app (kind c|cpp) or the test driver (driver), built against this
        artifact with the one-line command of examples/c_app/README.md."""
        if kind not in self._apps:
            src = {"c": APP / "mha_app.c", "cpp": APP / "mha_app.cpp",
                   "driver": self.dir.parent / "driver.c"}[kind]
            self._apps[kind] = build_c_app(
                CXX if kind == "cpp" else CC, self.dir, self.dir.parent / f"{self.dir.name}.{kind}",
                src, "c++17" if kind == "cpp" else "c11", ["-lpthread"] if kind == "driver" else [])
        return self._apps[kind]

    def run(self, kind, *args):
        return subprocess.run([str(self.app(kind)), *map(str, args)], capture_output=True,
                              text=True, timeout=120)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("artifacts")
    (path / "driver.c").write_text(DRIVER)
    return path


@pytest.fixture(scope="module")
def artifacts(root):
    cache = {}

    def get(key):
        if key not in cache:
            cache[key] = Artifact(key, root)
        return cache[key]
    return get


@pytest.fixture(scope="module")
def small(artifacts):
    return artifacts("small-causal")


def copy_of(art, tmp_path):
    """A copy of the artifact directory to damage (the apps keep using the original libmha.so,
    which checks the copy's files)."""
    return Path(shutil.copytree(art.dir, tmp_path / "copy"))


# -- the directory -------------------------------------------------------------------------
def test_artifact_layout(small):
    d = small.dir
    for name in ("kernel.so", "weights.safetensors", "manifest.json", "mha.h", "libmha.so",
                 "mha_config.h", "mha_libraries.h", "mha_runtime.h", "mha_runtime.cc", "mha_cpu.h",
                 "lib/libtvm_ffi.so", "lib/libtvm_runtime.so", "lib/libmha_impl.so"):
        assert (d / name).is_file(), name
    man = json.loads((d / "manifest.json").read_text())
    assert man["content_hash"] == content_hash(man)
    assert "tuning" in man and man["tvm_version"] and man["mhagen_version"]
    assert man["c_api"]["library"] == "libmha.so" and "skipped" not in man["c_api"]
    header = (d / "mha.h").read_text()
    for text in ("#define MHA_BATCH 2", "#define MHA_SEQ_LEN 17", "#define MHA_D_MODEL 64",
                 f"#define MHA_FORMAT_VERSION {man['version']}", man["content_hash"],
                 "MHA_ERR_SHAPE", "mutex", "64-byte aligned", "causal=True"):
        assert text in header, text
    readelf = shutil.which("readelf")
    if readelf:
        def dynamic(name):
            return subprocess.run([readelf, "-d", str(d / name)], capture_output=True,
                                  text=True).stdout
        # the program links the loader only; the runtime library finds TVM's beside it
        assert "libtvm" not in dynamic("libmha.so")
        runtime = dynamic("lib/libmha_impl.so")
        assert "$ORIGIN" in runtime and "libtvm_runtime.so" in runtime
    text = describe(d)
    assert "content hash" in text and "C API" in text and "kernel  attention(" in text


def test_python_load_still_works_and_checks_content_hash(small, tmp_path):
    loaded = mhagen.load(small.dir)
    assert_close(loaded(small.x), small.expected)
    d = copy_of(small, tmp_path)
    man = json.loads((d / "manifest.json").read_text())
    man["shapes"]["dtype"] = "float16"   # an edit no other check looks at
    (d / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(mhagen.ArtifactError, match="content hash"):
        mhagen.load(d)


def test_no_cxx_compiler_skips_c_api_with_a_note(small, tmp_path, monkeypatch):
    module = mhagen.build(small.layer, "x86", batch=small.batch, seq_len=small.seq_len,
                          weights=small.w)
    from mhagen.artifact import toolchain
    monkeypatch.setattr(toolchain, "_which", lambda program: None)   # a host without g++
    d = module.save(tmp_path / "m")
    man = json.loads((d / "manifest.json").read_text())
    assert "no C++ compiler" in man["c_api"]["skipped"]
    assert not (d / "libmha.so").exists() and not (d / "mha.h").exists()
    assert_close(mhagen.load(d)(small.x), small.expected)


# -- the example apps against the reference ------------------------------------------------
@pytest.mark.parametrize("key", list(ARTIFACTS))
def test_c_app_matches_reference(artifacts, key):
    art = artifacts(key)
    out = art.dir.parent / f"{key}.y.f32"
    r = art.run("c", art.dir, art.xfile, out)
    assert r.returncode == 0, r.stderr
    assert f"y: [{art.batch}, {art.seq_len}, " in r.stdout and "wrote" in r.stdout
    y = np.fromfile(out, np.float32).reshape(art.expected.shape)
    assert max_error(y, art.expected) < 1e-4
    assert_close(y, art.expected)


@pytest.mark.parametrize("key", ["small-causal", "default-512x8"])
def test_cpp_app_matches_reference(artifacts, key):
    art = artifacts(key)
    out = art.dir.parent / f"{key}.cpp.y.f32"
    r = art.run("cpp", art.dir, art.xfile, out)
    assert r.returncode == 0, r.stderr
    y = np.fromfile(out, np.float32).reshape(art.expected.shape)
    assert max_error(y, art.expected) < 1e-4
    assert_close(y, art.expected)


@pytest.mark.skipif(not shutil.which("cmake"), reason="needs cmake")
def test_cmake_builds_the_cpp_app(small, tmp_path):
    build = tmp_path / "build"
    for cmd in (["cmake", "-S", str(APP), "-B", str(build), f"-DMHA_ARTIFACT={small.dir}"],
                ["cmake", "--build", str(build), "--target", "mha_app_cpp"]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([str(build / "mha_app_cpp"), str(small.dir), str(small.xfile),
                        str(tmp_path / "y.f32")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    y = np.fromfile(tmp_path / "y.f32", np.float32).reshape(small.expected.shape)
    assert_close(y, small.expected)


def test_app_reports_a_bad_input_file(small, tmp_path):
    bad = tmp_path / "short.f32"
    small.x.ravel()[:10].tofile(bad)
    r = small.run("c", small.dir, bad)
    assert r.returncode == 1 and "must hold exactly" in r.stderr


# -- damaged artifacts: a clean message and a non-zero exit, never a crash -----------------
def _flip(path, at=100):
    data = bytearray(path.read_bytes())
    data[min(at, len(data) - 1)] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-7])


DAMAGE = {
    "corrupt-params": (lambda d: _flip(d / "weights.safetensors", 3000), "MHA_ERR_CORRUPT",
                       "weights.safetensors is corrupted"),
    "corrupt-params-header": (lambda d: _flip(d / "weights.safetensors", 20), "MHA_ERR_CORRUPT",
                              "weights.safetensors is corrupted"),
    "corrupt-kernel": (lambda d: _flip(d / "kernel.so", 5000), "MHA_ERR_CORRUPT",
                       "kernel.so is corrupted"),
    "truncated-params": (lambda d: _truncate(d / "weights.safetensors"), "MHA_ERR_CORRUPT",
                         "truncated"),
    "missing-params": (lambda d: (d / "weights.safetensors").unlink(), "MHA_ERR_NOT_FOUND",
                       "weights.safetensors is missing"),
    "missing-manifest": (lambda d: (d / "manifest.json").unlink(), "MHA_ERR_NOT_FOUND",
                         "manifest.json is missing"),
    "garbage-manifest": (lambda d: (d / "manifest.json").write_text("{not json"),
                         "MHA_ERR_CORRUPT", "not an mhagen module manifest"),
    "newer-format": (lambda d: _edit_manifest(d, version=lambda v: v + 1), "MHA_ERR_VERSION",
                     "newer than"),
    "older-format": (lambda d: _edit_manifest(d, version=lambda v: v - 1), "MHA_ERR_VERSION",
                     "older than"),
    "other-build": (lambda d: _edit_manifest(d, content_hash=lambda h: "0" * 64),
                    "MHA_ERR_MISMATCH", "use the mha.h and libmha.so of that directory"),
    "missing-dir": (lambda d: shutil.rmtree(d), "MHA_ERR_NOT_FOUND", "no artifact directory"),
    # libmha.so links no TVM: it checks lib/ before it opens the runtime (a truncated library
    # the dynamic loader maps at program start killed the program with SIGBUS)
    "truncated-tvm-runtime": (lambda d: _truncate(d / "lib/libtvm_runtime.so"),
                              "MHA_ERR_CORRUPT", "libtvm_runtime.so has"),
    "halved-tvm-ffi": (lambda d: _halve(d / "lib/libtvm_ffi.so"), "MHA_ERR_CORRUPT",
                       "libtvm_ffi.so has"),
    "halved-runtime-library": (lambda d: _halve(d / "lib/libmha_impl.so"), "MHA_ERR_CORRUPT",
                               "truncated"),
    "corrupt-tvm-runtime": (lambda d: _flip(d / "lib/libtvm_runtime.so", 5000),
                            "MHA_ERR_CORRUPT", "libtvm_runtime.so is corrupted"),
    "missing-runtime-library": (lambda d: (d / "lib/libmha_impl.so").unlink(),
                                "MHA_ERR_NOT_FOUND", "libmha_impl.so is missing"),
}


def _halve(path):
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def _edit_manifest(d, **edits):
    man = json.loads((d / "manifest.json").read_text())
    for key, f in edits.items():
        man[key] = f(man[key])
    (d / "manifest.json").write_text(json.dumps(man, indent=1))


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_artifact_gives_clean_error(small, tmp_path, case):
    damage, status, message = DAMAGE[case]
    d = copy_of(small, tmp_path)
    damage(d)
    r = small.run("c", d, small.xfile)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert f"mha_app: error: {status}: " in r.stderr and message in r.stderr, r.stderr
    r = small.run("driver", "create", d)        # the code itself, through mha_last_error_code
    assert r.returncode == 0 and r.stdout.split("|")[0] == status, r.stdout + r.stderr


def test_inspect_checks_every_file_libmha_too(small, tmp_path, capsys):
    """libmha.so cannot report its own damage (the dynamic loader maps it first): `mhagen
    inspect DIR --what manifest` checks it, and every other file, against the manifest."""
    from mhagen.cli import main
    d = copy_of(small, tmp_path)
    assert main(["inspect", str(d), "--what", "manifest"]) == 0
    assert "every file matches its sha256" in capsys.readouterr().out
    _truncate(d / "libmha.so")
    (d / "lib/libtvm_ffi.so").unlink()
    assert main(["inspect", str(d), "--what", "manifest"]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED: lib/libtvm_ffi.so (missing), libmha.so (sha256 differs)" in out, out


def test_the_params_file_is_safetensors_at_the_offsets_libmha_reads(small):
    """weights.safetensors holds the kernels' params: the safetensors package reads them, and
    each lies at the byte offset baked into mha_config.h (what libmha.so copies)."""
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    d = small.dir
    theirs = safetensors_numpy.load_file(str(d / "weights.safetensors"))
    params = mhagen.load(d).bound_params
    assert sorted(theirs) == sorted(params)
    raw = (d / "weights.safetensors").read_bytes()
    config = (d / "mha_config.h").read_text()
    man = json.loads((d / "manifest.json").read_text())
    for e in man["params"]:
        assert np.array_equal(theirs[e["name"]], params[e["name"]]), e["name"]
        at = e["offset"]
        assert raw[at:at + e["nbytes"]] == np.ascontiguousarray(params[e["name"]]).tobytes()
        assert f", {e['nbytes']}, {at}, " in config, e["name"]


def test_the_c_example_reads_the_weights_file(small, tmp_path):
    """examples/c_app/weights_info.c, a safetensors reader in plain C: it lists the tensors
    the safetensors package reads, at the offsets libmha.so reads, and copies one out bit for
    bit; a damaged file gives a message and exit status 1."""
    exe = tmp_path / "weights_info"
    subprocess.run([CC, "-O2", "-std=c11", "-Wall", "-Wextra", "-Werror",
                    str(APP / "weights_info.c"), "-o", str(exe)], check=True)
    d = small.dir
    man = json.loads((d / "manifest.json").read_text())
    params = mhagen.load(d).bound_params
    name = man["params"][0]["name"]
    r = subprocess.run([str(exe), str(d / "weights.safetensors"), name, str(tmp_path / "t")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    dtypes = {"float32": "F32", "int32": "I32", "bfloat16": "BF16", "float16": "F16"}
    assert sorted(r.stdout.splitlines()) == sorted(
        f"{e['name']} {dtypes[e['dtype']]} [{', '.join(map(str, e['shape']))}] "
        f"{e['nbytes']} bytes at {e['offset']}" for e in man["params"])
    assert (tmp_path / "t").read_bytes() == np.ascontiguousarray(params[name]).tobytes()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((d / "weights.safetensors").read_bytes()[:-9])
    r = subprocess.run([str(exe), str(bad)], capture_output=True, text=True)
    assert r.returncode == 1 and "data_offsets lie outside the file" in r.stderr, r.stderr


def test_lib_links_to_the_shared_runtime_and_a_cleared_cache_is_named(small, tmp_path):
    """lib/ links TVM's runtime libraries to one copy in mhagen's cache; with that copy gone,
    mha_create names the link and its missing target (a copy made with symlinks kept)."""
    for name in ("libtvm_ffi.so", "libtvm_runtime.so"):
        assert (small.dir / "lib" / name).is_symlink(), name
    d = Path(shutil.copytree(small.dir, tmp_path / "copy", symlinks=True))
    gone = tmp_path / "cleared-cache" / "libtvm_ffi.so"
    (d / "lib/libtvm_ffi.so").unlink()
    (d / "lib/libtvm_ffi.so").symlink_to(gone)
    r = small.run("c", d, small.xfile)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "MHA_ERR_NOT_FOUND" in r.stderr and f"links to {gone}, which is missing" in \
        r.stderr and "self_contained=True" in r.stderr, r.stderr


def test_a_self_contained_artifact_copies_the_runtime_and_runs(small, tmp_path):
    module = mhagen.build(small.layer, "x86", batch=small.batch, seq_len=small.seq_len,
                          weights=small.w)
    d = module.save(tmp_path / "m", self_contained=True)
    for name in ("libtvm_ffi.so", "libtvm_runtime.so"):
        assert (d / "lib" / name).is_file() and not (d / "lib" / name).is_symlink(), name
    assert "shared_runtime" not in json.loads((d / "manifest.json").read_text())["c_api"]
    r = small.run("c", d, small.xfile, tmp_path / "y.f32")
    assert r.returncode == 0, r.stderr
    y = np.fromfile(tmp_path / "y.f32", np.float32).reshape(small.expected.shape)
    assert_close(y, small.expected)


def test_another_artifacts_directory_is_refused(small, artifacts):
    other = artifacts("padded-out-d40")
    r = small.run("driver", "create", other.dir)
    assert r.stdout.startswith("MHA_ERR_MISMATCH|"), r.stdout + r.stderr


# -- the API's error codes and guarantees (the driver below) --------------------------------
@pytest.mark.parametrize("case,status,message", [
    ("create", "MHA_OK", ""),
    ("null_dir", "MHA_ERR_NULL_ARGUMENT", "artifact_dir is NULL"),
    ("null_handle", "MHA_ERR_NULL_ARGUMENT", "handle is NULL"),
    ("null_x", "MHA_ERR_NULL_ARGUMENT", "x is NULL"),
    ("null_y", "MHA_ERR_NULL_ARGUMENT", "y is NULL"),
    ("wrong_batch", "MHA_ERR_SHAPE", "compiled for batch=2, seq_len=17 only"),
    ("wrong_seq", "MHA_ERR_SHAPE", "--seq-len 18"),
    ("negative_seq", "MHA_ERR_SHAPE", "seq_len=-1"),
    ("ok_after_error", "MHA_OK", ""),
    ("unaligned", "MHA_OK", "same result"),
    ("threads", "MHA_OK", "8 threads agree"),
])
def test_api_status_codes(small, case, status, message):
    r = small.run("driver", case, small.dir)
    assert r.returncode == 0, r.stdout + r.stderr
    got_status, got_message = r.stdout.strip().split("|", 1)
    assert got_status == status and message in got_message, r.stdout


DRIVER = r"""
/* Test driver: prints "STATUS_NAME|message" for one case of the C API. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mha.h"

static void report(int code) { printf("%s|%s\n", mha_status_name(code), mha_last_error()); }

static float *filled(size_t n, size_t pad) {  /* 64-byte aligned, pad extra floats */
  float *p = aligned_alloc(64, ((n + pad) * sizeof(float) + 63) / 64 * 64);
  for (size_t i = 0; i < n + pad; ++i) p[i] = (float)((i * 7919) % 1000) / 500.0f - 1.0f;
  return p;
}

struct job { mha_handle *h; const float *x; const float *expected; int ok; };

static void *worker(void *arg) {
  struct job *j = arg;
  float *y = malloc(sizeof(float) * MHA_OUTPUT_SIZE + 4);
  j->ok = 1;
  for (int it = 0; it < 25; ++it) {
    float *out = (it % 2) ? y + 1 : y;   /* aligned and unaligned y */
    if (mha_run(j->h, j->x, MHA_BATCH, MHA_SEQ_LEN, out) != MHA_OK ||
        memcmp(out, j->expected, sizeof(float) * MHA_OUTPUT_SIZE) != 0)
      j->ok = 0;
  }
  free(y);
  return NULL;
}

int main(int argc, char **argv) {
  if (argc != 3) return 2;
  const char *c = argv[1];
  if (!strcmp(c, "null_dir")) { (void)mha_create(NULL); report(mha_last_error_code()); return 0; }
  if (!strcmp(c, "null_handle")) {
    float x[1] = {0}, y[1] = {0};
    report(mha_run(NULL, x, MHA_BATCH, MHA_SEQ_LEN, y));
    return 0;
  }
  mha_handle *h = mha_create(argv[2]);
  if (!strcmp(c, "create") || h == NULL) {
    report(mha_last_error_code());
    mha_destroy(h);
    return 0;
  }
  float *x = filled(MHA_INPUT_SIZE, 1), *y = filled(MHA_OUTPUT_SIZE, 1);
  float *y2 = filled(MHA_OUTPUT_SIZE, 1);
  int rc = MHA_OK;
  if (!strcmp(c, "null_x")) rc = mha_run(h, NULL, MHA_BATCH, MHA_SEQ_LEN, y);
  else if (!strcmp(c, "null_y")) rc = mha_run(h, x, MHA_BATCH, MHA_SEQ_LEN, NULL);
  else if (!strcmp(c, "wrong_batch")) rc = mha_run(h, x, MHA_BATCH + 1, MHA_SEQ_LEN, y);
  else if (!strcmp(c, "wrong_seq")) rc = mha_run(h, x, MHA_BATCH, MHA_SEQ_LEN + 1, y);
  else if (!strcmp(c, "negative_seq")) rc = mha_run(h, x, MHA_BATCH, -1, y);
  else if (!strcmp(c, "ok_after_error")) {
    mha_run(h, x, 0, 0, y);
    rc = mha_run(h, x, MHA_BATCH, MHA_SEQ_LEN, y);
  } else if (!strcmp(c, "unaligned")) {
    /* the same values at an aligned and a 4-byte-offset address give the same bits */
    float *xu = filled(MHA_INPUT_SIZE, 1);
    memmove(xu + 1, x, sizeof(float) * MHA_INPUT_SIZE);
    rc = mha_run(h, x, MHA_BATCH, MHA_SEQ_LEN, y);
    if (rc == MHA_OK) rc = mha_run(h, xu + 1, MHA_BATCH, MHA_SEQ_LEN, y2 + 1);
    free(xu);
    if (rc == MHA_OK) {
      int same = !memcmp(y, y2 + 1, sizeof(float) * MHA_OUTPUT_SIZE);
      printf("%s|%s\n", same ? "MHA_OK" : "MISMATCH", same ? "same result" : "differs");
    }
  } else if (!strcmp(c, "threads")) {
    rc = mha_run(h, x, MHA_BATCH, MHA_SEQ_LEN, y);
    struct job jobs[8];
    pthread_t t[8];
    for (int i = 0; i < 8; ++i) {
      jobs[i] = (struct job){h, x, y, 0};
      pthread_create(&t[i], NULL, worker, &jobs[i]);
    }
    int ok = rc == MHA_OK;
    for (int i = 0; i < 8; ++i) pthread_join(t[i], NULL), ok &= jobs[i].ok;
    printf("%s|%s\n", ok ? "MHA_OK" : "MISMATCH", ok ? "8 threads agree" : "threads differ");
  } else {
    rc = -1;
  }
  if (rc != -1 && strcmp(c, "unaligned") && strcmp(c, "threads")) report(rc);
  mha_destroy(h);
  free(x), free(y), free(y2);
  return rc == -1 ? 2 : 0;
}
"""


# -- lengths and K/V caches: mha_run_padded, mha_run_cached --------------------------------
LENGTHS_DRIVER = r"""
/* Test driver for mha_run_padded / mha_run_cached: runs one case, prints
   "STATUS_NAME|message|lens" (lens: the cache lengths after the call), and for "padded" and
   "cached" writes y (and the caches) to the given file. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mha.h"

static void *aligned(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

int main(int argc, char **argv) {
  if (argc != 5) return 2;
  const char *c = argv[1];
  mha_handle *h = mha_create(argv[2]);
  if (!h) { printf("%s|%s|\n", mha_status_name(mha_last_error_code()), mha_last_error()); return 0; }
  mha_value *x = aligned(MHA_INPUT_SIZE * sizeof(mha_value));
  mha_value *y = aligned(MHA_OUTPUT_SIZE * sizeof(mha_value));
  FILE *f = fopen(argv[3], "rb");
  if (!f || fread(x, sizeof(mha_value), MHA_INPUT_SIZE, f) != MHA_INPUT_SIZE) return 3;
  fclose(f);
  size_t cache_size = MHA_CACHE_SIZE ? MHA_CACHE_SIZE : 1;
  mha_cache_value *k = aligned((cache_size + 32) * sizeof(mha_cache_value));
  mha_cache_value *v = aligned((cache_size + 32) * sizeof(mha_cache_value));
  memset(k, 0, (cache_size + 32) * sizeof(mha_cache_value));
  memset(v, 0, (cache_size + 32) * sizeof(mha_cache_value));
  int32_t lens[MHA_BATCH];
  for (int b = 0; b < MHA_BATCH; ++b) lens[b] = b == 0 ? 0 : 3;
  int rc;
  if (!strcmp(c, "plain")) rc = mha_run(h, x, MHA_BATCH, MHA_SEQ_LEN, y);
  else if (!strcmp(c, "padded")) {
    for (int b = 0; b < MHA_BATCH; ++b) lens[b] = b == 0 ? MHA_SEQ_LEN : b;
    rc = mha_run_padded(h, x, MHA_BATCH, MHA_SEQ_LEN, lens, y);
  } else if (!strcmp(c, "padded_too_long")) {
    lens[0] = MHA_SEQ_LEN + 1;
    rc = mha_run_padded(h, x, MHA_BATCH, MHA_SEQ_LEN, lens, y);
  } else if (!strcmp(c, "cached")) {
    rc = mha_run_cached(h, x, MHA_BATCH, MHA_SEQ_LEN, k, v, lens, y);
    if (rc == MHA_OK) rc = mha_run_cached(h, x, MHA_BATCH, MHA_SEQ_LEN, k, v, lens, y);
  } else if (!strcmp(c, "cache_full")) {
    lens[0] = MHA_KV_CACHE - MHA_SEQ_LEN + 1;
    rc = mha_run_cached(h, x, MHA_BATCH, MHA_SEQ_LEN, k, v, lens, y);
  } else if (!strcmp(c, "cache_unaligned")) {
    rc = mha_run_cached(h, x, MHA_BATCH, MHA_SEQ_LEN, k + 1, v, lens, y);
  } else if (!strcmp(c, "cache_null")) {
    rc = mha_run_cached(h, x, MHA_BATCH, MHA_SEQ_LEN, k, v, NULL, y);
  } else return 2;
  printf("%s|%s|", mha_status_name(rc), mha_last_error());
  for (int b = 0; b < MHA_BATCH; ++b) printf("%d ", lens[b]);
  printf("\n");
  if (rc == MHA_OK) {
    f = fopen(argv[4], "wb");
    fwrite(y, sizeof(mha_value), MHA_OUTPUT_SIZE, f);
    if (MHA_CACHE_SIZE) {
      fwrite(k, sizeof(mha_cache_value), MHA_CACHE_SIZE, f);
      fwrite(v, sizeof(mha_cache_value), MHA_CACHE_SIZE, f);
    }
    fclose(f);
  }
  mha_destroy(h);
  return 0;
}
"""


@pytest.fixture(scope="module")
def lengths_artifacts(root):
    """A key-padding artifact (batch 2, seq 9) and a decoding one (batch 2, 3 new tokens,
    cache 16), each with the lengths driver built against it."""
    (root / "lengths_driver.c").write_text(LENGTHS_DRIVER)
    out = {}
    decoding = dict(kv_cache=16, kv_heads=2, causal=True, rotary=True)
    for key, kwargs, seq in (("padded", dict(key_padding=True, causal=True), 9),
                             ("cached", decoding, 3),
                             ("cached-bfloat16", dict(decoding, dtype="bfloat16"), 3),
                             ("cached-float16-cache", dict(decoding, cache_dtype="float16"),
                              3)):
        layer = mhagen.mha(64, 4, **kwargs)
        w = layer.init_weights(2)
        module = mhagen.build(layer, "x86", batch=2, seq_len=seq, weights=w)
        d = module.save(root / f"lengths-{key}")
        exe = build_c_app(CC, d, root / f"lengths-{key}.driver", root / "lengths_driver.c")
        x = random_input(layer, 2, seq, seed=4).astype(module.dtype)
        x.tofile(root / f"lengths-{key}.x")
        out[key] = (layer, w, module, exe, x)
    return out


def _drive(root, lengths_artifacts, key, case):
    layer, w, module, exe, x = lengths_artifacts[key]
    yfile = root / f"{key}-{case}.y"
    r = subprocess.run([str(exe), case, str(root / f"lengths-{key}"), str(root / f"lengths-{key}.x"),
                        str(yfile)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    status, message, lens = r.stdout.strip().split("|")
    return status, message, [int(v) for v in lens.split()], yfile


def test_c_api_key_padding_matches_python(root, lengths_artifacts):
    layer, w, module, exe, x = lengths_artifacts["padded"]
    status, message, _, yfile = _drive(root, lengths_artifacts, "padded", "padded")
    assert status == "MHA_OK", message
    kv_lens = np.array([9, 1])
    y = np.fromfile(yfile, np.float32).reshape(x.shape)
    assert_close(y, layer.reference(x, w, kv_lens=kv_lens))
    np.testing.assert_array_equal(y, module(x, kv_lens=kv_lens))
    assert "MHA_KEY_PADDING 1" in (root / "lengths-padded" / "mha.h").read_text()


@pytest.mark.parametrize("key", ["cached", "cached-bfloat16", "cached-float16-cache"])
def test_c_api_decoding_matches_python(root, lengths_artifacts, key):
    """Two calls of 3 new tokens on rows cached 0 and 3 deep: the second call's output, the
    caches and the lengths equal the Python module's (a bfloat16 layer: bfloat16 x and y,
    float32 caches; a float16 cache: mha_cache_value holds binary16)."""
    layer, w, module, exe, x = lengths_artifacts[key]
    status, message, lens, yfile = _drive(root, lengths_artifacts, key, "cached")
    assert status == "MHA_OK" and lens == [6, 9], (message, lens)
    cache = module.new_cache()
    cache.lens[...] = [0, 3]
    module(x, cache=cache)
    expected = module(x, cache=cache)
    raw = yfile.read_bytes()
    n = expected.nbytes
    got = np.frombuffer(raw[:n], expected.dtype).reshape(expected.shape)
    np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))
    caches = np.frombuffer(raw[n:], cache.k.dtype)
    np.testing.assert_array_equal(caches[:cache.k.size].reshape(cache.k.shape), cache.k)
    np.testing.assert_array_equal(caches[cache.k.size:].reshape(cache.v.shape), cache.v)
    header = (root / f"lengths-{key}" / "mha.h").read_text()
    assert f'#define MHA_CACHE_DTYPE "{cache.k.dtype}"' in header


@pytest.mark.parametrize("key,case,status,message", [
    ("cached", "plain", "MHA_ERR_ARGUMENT", "runs with mha_run_cached"),
    ("padded", "plain", "MHA_ERR_ARGUMENT", "runs with mha_run_padded"),
    ("padded", "cached", "MHA_ERR_ARGUMENT", "runs with mha_run_padded"),
    ("padded", "padded_too_long", "MHA_ERR_ARGUMENT", "outside 0..9"),
    ("cached", "cache_full", "MHA_ERR_ARGUMENT", "the cache holds 16 tokens"),
    ("cached", "cache_unaligned", "MHA_ERR_ARGUMENT", "64-byte aligned"),
    ("cached", "cache_null", "MHA_ERR_NULL_ARGUMENT", "lengths are NULL"),
])
def test_c_api_length_errors(root, lengths_artifacts, key, case, status, message):
    got, text, lens, _ = _drive(root, lengths_artifacts, key, case)
    assert got == status and message in text, text
    if key == "cached" and case != "cache_null":
        assert lens[1] == 3      # nothing advanced on an error


@pytest.mark.parametrize("seq_len,calls,cache_dtype", [(1, 29, "float32"),
                                                      (None, 17, "float32"),
                                                      (None, 17, "bfloat16")],
                         ids=["step", "any-length", "bfloat16-cache"])
def test_c_decode_example_matches_the_whole_sequence(root, seq_len, calls, cache_dtype):
    """examples/c_app/decode.c, built with its one-line command against a decoding artifact
    (batch 1; seq_len 1, or any number of new tokens up to 16), feeds 29 tokens: a prompt of
    13 (in one call when the artifact takes it), then 16 decode steps. Equals the causal
    layer on all 29 (a bfloat16 cache: the reference fed the same calls, its cache rows
    rounded as the layer says)."""
    kw = dict(kv_heads=2, causal=True, rotary=True)
    layer = mhagen.mha(64, 4, kv_cache=40, cache_dtype=cache_dtype, **kw)
    w = layer.init_weights(0)
    lengths = dict(seq_len=1) if seq_len else dict(seq_len=None, max_seq_len=16)
    name = f"decode-{seq_len}-{cache_dtype}"
    d = mhagen.build(layer, "x86", batch=1, weights=w, **lengths).save(root / name)
    exe = build_c_app(CC, d, root / f"{name}.exe", APP / "decode.c", extra=["-Wextra"])
    x = random_input(layer, 1, 29, seed=6)
    x.tofile(root / "decode.x")
    r = subprocess.run([str(exe), str(d), str(root / "decode.x"), "29", str(root / "decode.y"),
                        "13"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"29 tokens in {calls} calls" in r.stdout and "the cache holds 29 of 40" in r.stdout
    y = np.fromfile(root / "decode.y", np.float32).reshape(x.shape)
    assert_close(y, *decoding_reference(layer, mhagen.mha(64, 4, **kw), w, x, [13] + [1] * 16))
    if seq_len is None:
        return
    # a decode.c built against a non-decoding artifact stops at compile time, with the reason
    plain = mhagen.build(mhagen.mha(64, 4), "x86", batch=1, seq_len=1,
                         weights=mhagen.mha(64, 4).init_weights(0)).save(root / "plain-1")
    r = subprocess.run([CC, "-std=c11", "-fsyntax-only", str(APP / "decode.c"), f"-I{plain}"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "needs the mha.h of a decoding artifact" in r.stderr


# -- packed calls: mha_run_varlen ----------------------------------------------------------
VARLEN_DRIVER = r"""
/* Test driver for mha_run_varlen: `driver CASE DIR X CU [CONTEXT CU_K]` runs one packed call
   of the offsets CU ("0,5,5,40"; CU_K the context's) on x (and the context) read from files,
   prints "STATUS_NAME|message|untouched" (untouched: y still holds the 7s it was filled
   with) and writes y to X.y. Cases: ok, unaligned (x and y off the 64-byte grid), null_cu,
   no_sequences, no_context. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mha.h"

static int offsets(const char *text, int32_t *cu) {
  int n = 0;
  for (const char *p = text; *p; ++n) {
    cu[n] = (int32_t)strtol(p, (char **)&p, 10);
    if (*p == ',') ++p;
  }
  return n - 1;
}

static mha_value *read_values(const char *path, size_t n, size_t offset) {
  mha_value *a = aligned_alloc(64, ((n + offset) * sizeof(mha_value) + 64) / 64 * 64);
  FILE *f = fopen(path, "rb");
  if (!f || fread(a + offset, sizeof(mha_value), n, f) != n) exit(3);
  fclose(f);
  return a;
}

int main(int argc, char **argv) {
  if (argc != 5 && argc != 7) return 2;
  const char *c = argv[1];
  mha_handle *h = mha_create(argv[2]);
  if (!h) {
    printf("%s|%s|\n", mha_status_name(mha_last_error_code()), mha_last_error());
    return 0;
  }
  int32_t cu[64], cu_k[64];
  const int n = offsets(argv[4], cu);
  const size_t off = strcmp(c, "unaligned") ? 0 : 1;   /* values of x and y off the grid */
  size_t total = 0;
  for (int i = 0; i <= n; ++i) total = (size_t)cu[i] > total ? (size_t)cu[i] : total;
  mha_value *x = read_values(argv[3], total * MHA_D_MODEL, off);
  mha_value *context = NULL;
  if (argc == 7) {
    offsets(argv[6], cu_k);
    size_t rows = 0;
    for (int i = 0; i <= n; ++i) rows = (size_t)cu_k[i] > rows ? (size_t)cu_k[i] : rows;
    context = read_values(argv[5], rows * MHA_KV_DIM, 0);
  }
  size_t ny = (total ? total : 1) * MHA_OUT_D_MODEL;
  mha_value *y = aligned_alloc(64, ((ny + off) * sizeof(mha_value) + 64) / 64 * 64);
  for (size_t i = 0; i < ny + off; ++i) y[i] = (mha_value)7;
  int rc;
  if (!strcmp(c, "null_cu")) rc = mha_run_varlen(h, x + off, NULL, n, context, NULL, y + off);
  else if (!strcmp(c, "no_sequences")) rc = mha_run_varlen(h, x, cu, 0, context, cu_k, y);
  else if (!strcmp(c, "no_context")) rc = mha_run_varlen(h, x, cu, n, NULL, cu_k, y);
  else rc = mha_run_varlen(h, x + off, cu, n, context, argc == 7 ? cu_k : NULL, y + off);
  int untouched = 1;
  for (size_t i = 0; i < ny + off; ++i) untouched &= y[i] == (mha_value)7;
  printf("%s|%s|%d\n", mha_status_name(rc), mha_last_error(), untouched);
  if (rc == MHA_OK) {
    char path[4096];
    snprintf(path, sizeof path, "%s.y", argv[3]);
    FILE *f = fopen(path, "wb");
    fwrite(y + off, sizeof(mha_value), total * MHA_OUT_D_MODEL, f);
    fclose(f);
  }
  mha_destroy(h);
  return 0;
}
"""


@pytest.fixture(scope="module")
def varlen_driver(root):
    path = root / "varlen_driver.c"
    path.write_text(VARLEN_DRIVER)
    return path


@pytest.fixture(scope="module")
def varlen_artifacts(root, varlen_driver):
    """Any-length artifacts taking packed calls, each with the varlen driver: causal grouped
    K/V heads with RoPE and ALiBi (sequences up to 40, 2 x 40 tokens), and cross-attention
    (sequences up to 24, contexts up to 16)."""
    out = {}
    for key, kwargs, extra in (
            ("rope", dict(kv_heads=2, causal=True, rotary=True, score_mod=mhagen.alibi(4)),
             dict(max_seq_len=40)),
            ("cross", dict(cross=True, kv_dim=48),
             dict(max_seq_len=24, kv_seq_len=None, max_kv_seq_len=16))):
        layer = mhagen.mha(64, 4, **kwargs)
        w = layer.init_weights(2)
        module = mhagen.build(layer, "x86", batch=None, max_batch=2, seq_len=None,
                              weights=w, **extra)
        d = module.save(root / f"varlen-{key}")
        exe = build_c_app(CC, d, root / f"varlen-{key}.driver", varlen_driver)
        out[key] = (layer, w, module, d, exe)
    return out


def _offsets(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _varlen(root, exe, d, case, cu, cu_k=None, seed=7):
    """Run the varlen driver on artifact d: (status, message, y untouched, (x, context, y))
    for offsets cu (and cu_k) as given, x (and the context) random."""
    x = np.random.default_rng(seed).standard_normal((1, int(max(cu)), 64)).astype(np.float32)
    xfile = root / f"{d.name}-{case}.x"
    x.tofile(xfile)
    args = [case, d, xfile, ",".join(map(str, cu))]
    context = None
    if cu_k is not None:
        context = np.random.default_rng(seed).standard_normal((1, int(max(cu_k)), 48)).astype(
            np.float32)
        context.tofile(root / f"{d.name}-{case}.c")
        args += [root / f"{d.name}-{case}.c", ",".join(map(str, cu_k))]
    r = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    status, message, untouched = r.stdout.strip().split("|")
    y = np.fromfile(f"{xfile}.y", np.float32).reshape(1, -1, 64) if status == "MHA_OK" \
        else None
    return status, message, untouched == "1", (x, context, y)


@pytest.mark.parametrize("case", ["ok", "unaligned"])
def test_c_api_packed_call_matches_python(root, varlen_artifacts, case):
    """Sequences of 0, 1, 40 (the maximum), 17 and 0 tokens packed in one call from C (x and
    y aligned, or not): the module's packed call bit for bit, the reference within the
    tolerance; the artifact says it takes packed calls and how many tokens."""
    layer, w, module, d, exe = varlen_artifacts["rope"]
    cu = _offsets([0, 1, 40, 17, 0])
    status, message, _, (x, _, y) = _varlen(root, exe, d, case, cu)
    assert status == "MHA_OK", message
    np.testing.assert_array_equal(y, module(x, cu_seqlens=cu))
    assert_close(y, layer.reference(x, w, cu_seqlens=cu))
    header = (d / "mha.h").read_text()
    assert "#define MHA_PACKED 1" in header and "#define MHA_MAX_TOKENS 80" in header


def test_c_api_packed_cross_attention_matches_python(root, varlen_artifacts):
    layer, w, module, d, exe = varlen_artifacts["cross"]
    cu, cu_k = _offsets([5, 0, 24, 1]), _offsets([3, 2, 16, 1])
    status, message, _, (x, context, y) = _varlen(root, exe, d, "ok", cu, cu_k)
    assert status == "MHA_OK", message
    np.testing.assert_array_equal(
        y, module(x, cu_seqlens=cu, context=context, cu_seqlens_k=cu_k))
    assert_close(y, layer.reference(x, w, cu_seqlens=cu, context=context, cu_seqlens_k=cu_k))


@pytest.mark.parametrize("key,case,cu,cu_k,status,message", [
    ("rope", "ok", [0, 5, 3, 13], None, "MHA_ERR_ARGUMENT", "must never decrease: entry 2"),
    ("rope", "ok", [1, 5], None, "MHA_ERR_ARGUMENT", "start at 0"),
    ("rope", "ok", [0, 41], None, "MHA_ERR_SHAPE", "sequence 0 has 41 rows"),
    ("rope", "ok", [0, 40, 80, 81], None, "MHA_ERR_SHAPE", "packs at most 80 rows"),
    ("rope", "null_cu", [0, 5], None, "MHA_ERR_NULL_ARGUMENT", "cu_seqlens is NULL"),
    ("rope", "no_sequences", [0, 5], None, "MHA_ERR_ARGUMENT", "at least one sequence"),
    ("rope", "ok", [0, 3], [0, 3], "MHA_ERR_ARGUMENT", "not a cross-attention layer"),
    ("cross", "ok", [0, 5, 7], [0, 3, 3], "MHA_ERR_ARGUMENT",
     "sequence 1 has queries but no context rows"),
    ("cross", "ok", [0, 5], [0, 17], "MHA_ERR_SHAPE", "sequence 0 has 17 rows (cu_seqlens_k)"),
    ("cross", "no_context", [0, 5], [0, 3], "MHA_ERR_NULL_ARGUMENT", "context is NULL"),
])
def test_c_api_packed_call_errors_write_nothing(root, varlen_artifacts, key, case, cu, cu_k,
                                                status, message):
    _, _, _, d, exe = varlen_artifacts[key]
    got, text, untouched, _ = _varlen(root, exe, d, case, cu, cu_k)
    assert got == status and message in text, text
    assert untouched


def test_c_api_packed_call_on_an_artifact_without_packed_calls(root, small, varlen_driver):
    """An exact-length artifact's mha_run_varlen says how to get one that takes them."""
    exe = build_c_app(CC, small.dir, root / "small.varlen", varlen_driver)
    got, text, untouched, _ = _varlen(root, exe, small.dir, "ok", [0, 5])
    assert got == "MHA_ERR_ARGUMENT" and "--max-seq-len" in text and untouched
    assert "#define MHA_PACKED 0" in (small.dir / "mha.h").read_text()
