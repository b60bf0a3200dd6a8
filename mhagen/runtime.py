"""Runtime settings, read or changed in this one module (threads).

TVM sizes its thread pool once, from TVM_NUM_THREADS, else from half the logical CPUs
(it assumes hyper-threading: on a 2-core machine that is 1 thread). mhagen sets
TVM_NUM_THREADS to the usable cores before TVM starts, unless the user set it.
"""
import os


def prepare_tvm_threads() -> None:
    """Call before TVM's thread pool starts (mhagen does, on its first use of TVM)."""
    if "TVM_NUM_THREADS" not in os.environ:
        from mhagen.target import host_cores
        os.environ["TVM_NUM_THREADS"] = str(host_cores())


def set_num_threads(n: int) -> None:
    """Use n worker threads (1 <= n <= TVM_NUM_THREADS) for the following calls."""
    prepare_tvm_threads()
    import tvm  # noqa: F401  (registers the runtime functions)
    import tvm_ffi
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"threads must be a positive int, got {n!r}")
    tvm_ffi.get_global_func("runtime.config_threadpool")(0, n)


def num_threads() -> int:
    prepare_tvm_threads()
    import tvm  # noqa: F401
    import tvm_ffi
    return int(tvm_ffi.get_global_func("runtime.NumThreads")())
