"""The cpu-x86 backend family (mhagen/backends.py): the x86-only parts (AMX tiles, AVX-512
BF16 dot products, denormal flushing) beside the generic CPU rules of schedules/cpu/.
BACKEND (X86Backend) and RULES are imported on first use (schedules/x86/backend.py), so the
generic templates can import the x86 parts without a cycle."""


def __getattr__(name):
    if name in ("BACKEND", "RULES"):
        from mhagen.schedules.x86 import backend
        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
