"""The backend seam (mhagen/backends.py): one object per target, bound to it, answering for
its family; shared rules never test an architecture name."""
import dataclasses
import re
from pathlib import Path

import pytest

from mhagen.backends import Backend
from mhagen.errors import TargetError
from mhagen.target import resolve

ROOT = Path(__file__).resolve().parents[1]


def test_each_family_answers_for_itself():
    from mhagen.schedules.arm.backend import ArmBackend
    from mhagen.schedules.cuda import CudaBackend
    from mhagen.schedules.cpu.x86_backend import X86Backend
    avx512, amx, neon, cuda = (Backend.for_target(resolve(p)) for p in
                               ("x86-avx512", "x86-amx", "arm-neon", "cuda-sm90"))
    assert (type(avx512), type(neon), type(cuda)) == (X86Backend, ArmBackend, CudaBackend)
    assert avx512.target.name == "x86-avx512" and avx512.gemm_tile() == (12, 32)
    # AMX tiles for a bfloat16 GEMM of whole 32s, not in decoding layers (tiles=False)
    assert amx.gemm_path("bfloat16", 128) == "amx"
    assert amx.gemm_path("bfloat16", 128, tiles=False) != "amx"
    assert amx.gemm_path("float32", 128) == "float32"
    assert neon.gemm_path("bfloat16", 128) == cuda.gemm_path("float16", 64) == "float32"
    assert neon.attention_path("bfloat16", 64) is None
    # the x86 templates flush denormals in their tasks, the same templates on ARM do not
    assert avx512.attention.flush_denormals and avx512.decode.flush_denormals
    assert avx512.attention.x86_helpers and not neon.attention.x86_helpers
    assert not neon.attention.flush_denormals and not neon.decode.flush_denormals
    assert (avx512.symbolic, avx512.cross_attention, cuda.symbolic, cuda.decode) == (
        True, True, False, None)
    assert "fcvtl" in neon.precision_path("float16") and avx512.precision_path("float32") is None


def test_a_target_of_no_family_is_refused():
    t = dataclasses.replace(resolve("x86-avx2"), family="tpu")
    with pytest.raises(TargetError, match="no backend for target family 'tpu'"):
        Backend.for_target(t)


def test_shared_rules_never_test_an_architecture_name():
    shared = [*(ROOT / "schedules" / "cpu").glob("*.py"), ROOT / "schedules" / "__init__.py",
              ROOT / "schedules" / "attention_common.py", *(ROOT / "mhagen" / "lower").glob("*.py"),
              ROOT / "mhagen" / "compile.py"]
    named = [f"{p.relative_to(ROOT)}: {line.strip()}" for p in shared
             for line in p.read_text().splitlines()
             if re.search(r"\barch\b.*==|[\"'](x86_64|aarch64)[\"']", line)]
    assert not named, "\n".join(named)
