"""The cpu-arm backend family (aarch64: NEON, SVE): the generic CPU rules of schedules/cpu/.

They read only target attributes -- float32 lanes per vector (vector_bits / 32), vector
register count (vector_registers: 32 on aarch64), cores -- so they serve aarch64 unchanged:
128-bit NEON gets 4-lane tiles, 256-bit SVE (Neoverse-V1) 8-lane tiles that LLVM lowers to
fixed-length SVE (see targets/arm-sve.json). Tuned records of aarch64 CPU classes live in
schedules/arm/records/. BACKEND (ArmBackend) and RULES are imported on first use.
"""


def __getattr__(name):
    if name in ("BACKEND", "RULES"):
        from mhagen.schedules.arm import backend
        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
