"""Denormals flushed to zero inside the attention kernels' tasks (x86: MXCSR FTZ and DAZ).

The online softmax makes tiny values where scores lie far below their row's maximum (ALiBi's
steep slopes over long sequences): probabilities near 2^-126 times V, and accumulators
scaled down by alpha, come out denormal, and an Intel core takes a microcode assist for each
operation that makes or reads one: ALiBi layers ran several times slower than plain ones on
the Intel Xeon with AMX, and as fast flushed; AMD's Zen cores pay little for denormals (see
benchmarks/PERFORMANCE.md, Schedule decisions). Each task saves its thread's MXCSR, sets
FTZ | DAZ and puts
the saved value back at its end: the caller's floating-point state is left as it was (the
calling thread runs tasks too). What is flushed lies below 2^-126 of the row's largest
probability: below anything a float32 output shows; inputs already denormal (|q|, |k|, |v|
under 2^-126) read as zero in these kernels, as in a GPU kernel built with flush-to-zero.
The templates (attention, decode) call ENTER and EXIT themselves; the unfused path's softmax
and batched matmuls mark their parallel loops TASK, and the x86 backend's finalize step
(with_flush) wraps each task the same way.
"""
from tvm import tirx

from mhagen.schedules.tvmscript import wrap_loop_bodies

ENTER = "mhagen_flush_denormals"    # () -> the MXCSR it found; sets FTZ (bit 15), DAZ (bit 6)
EXIT = "mhagen_restore_mxcsr"       # (saved) -> 0
TASK = "mhagen_flush_task"          # a loop annotation: each iteration runs flushed (x86)

HELPERS = f"""
define i32 @{ENTER}() {{
  %p = alloca i32, align 4
  call void @llvm.x86.sse.stmxcsr(ptr %p)
  %old = load i32, ptr %p, align 4
  %new = or i32 %old, 32832
  store i32 %new, ptr %p, align 4
  call void @llvm.x86.sse.ldmxcsr(ptr %p)
  ret i32 %old
}}
define i32 @{EXIT}(i32 %old) {{
  %p = alloca i32, align 4
  store i32 %old, ptr %p, align 4
  call void @llvm.x86.sse.ldmxcsr(ptr %p)
  ret i32 0
}}
declare void @llvm.x86.sse.stmxcsr(ptr)
declare void @llvm.x86.sse.ldmxcsr(ptr)
"""


def with_flush(func, flush: bool):
    """func with every loop annotated TASK running ENTER first and EXIT last in each of its
    iterations (a parallel task), HELPERS linked in; flush False (targets other than x86):
    the annotation dropped only. func unchanged when it has no such loop."""
    from mhagen.schedules.x86.bf16_dot import with_llvm_ir

    def wrap(body):
        if not flush:
            return body
        saved = tirx.Var("mxcsr", "int32")
        return tirx.SeqStmt([tirx.Bind(saved, tirx.call_extern("int32", ENTER)), body,
                             tirx.Evaluate(tirx.call_extern("int32", EXIT, saved))])
    body = wrap_loop_bodies(func.body, TASK, wrap)
    if body is None:
        return func
    return with_llvm_ir(func.with_body(body), HELPERS) if flush else func.with_body(body)
