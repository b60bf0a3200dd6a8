"""The x86-only pieces of the cpu-x86 backend family (mhagen/backends.py): AMX tiles
(amx.py), AVX-512 BF16 dot products (bf16_dot.py), denormal flushing (denormals.py), the
LLVM IR transposes they link (transpose.py), and the family's tuned records (records/).
They import nothing of schedules/cpu/: the generic CPU templates and the X86Backend
(schedules/cpu/x86_backend.py) decide where they are used."""
