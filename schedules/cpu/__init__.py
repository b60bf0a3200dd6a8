"""Generic CPU schedule rules and templates (x86 and aarch64 alike): they read target
attributes (lanes, vector registers, caches, cores), never architecture names. The x86-only
parts (AMX tiles, AVX-512 BF16 dot products, denormal flushing) are in schedules/x86/;
the CPU backends (backend.py: CpuBackend, x86_backend.py: X86Backend) choose where they are
used. cpu/ imports x86/, never the reverse; schedules/arm/ imports cpu/."""
