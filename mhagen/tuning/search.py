"""mhagen.tune(): tune a layer's kernels for a target with TVM MetaSchedule.

Per kernel of the lowered program:
  - GEMM kernels (TE): MetaSchedule, first over our matmul template with its knob sampled
    (register tile rows; one trial per value), then its evolutionary search over TVM's
    generic post-order-apply space for the rest of the trials. Each kernel has a MetaSchedule
    JSON database under the work dir, so an interrupted run (Ctrl-C, time budget) keeps every
    measurement and a re-run resumes.
  - the attention template: its few knobs (query tile, key block) are measured side by side
    (each with its real block table); a decoding layer's decode template likewise (tasks a
    core, key block, row tile), on a full cache. A decoding layer's packed build (seq_len=None,
    `packed=True`) and paged build (`kv_block_size=B`) when asked: the decode template of
    that build, measured on a call of every row adding seq tokens (cu_seqlens) on a full
    cache (a pool whose blocks are shuffled), recorded under a key of its own (packed,
    kv_block_size: mhagen.records.database.decode_call_fields). The packed calls' attention of an
    any-length build (attention_varlen, mhagen/packed.py) when named in `kernels`: its
    record keyed by the build's maximum shape (batch, seq), measured on a packed call of
    `batch` sequences of `seq` tokens.
The default schedule and the best tuned one are then measured side by side with the same
steady-state timing the benchmark uses (interleaved rounds, medians); the record keeps the
tuned schedule only if it is at least 3% faster (kind "trace"/"config"), else records
"default", and only if its output matches the default's on the device it was timed on.
Records are keyed by CPU class and say which machine measured them.
A time budget holds for the whole run: a step starts only if the steps measured so far say
it ends in time (_Budget), and the deadline cuts one under way; the report says what it
stopped and how to resume (TuneReport.summary).
Measurements run locally or on a remote device through TVM's RPC tracker (MetaSchedule's
runner there).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import tvm

from mhagen.artifact.other_arch import ARCHES
from mhagen.errors import GraphError, InputError, MhagenError, TargetError
from mhagen.host import host_arch, host_cpu_model
from mhagen.lower import lower
from mhagen.packed import tile_table
from mhagen.records.database import Database, Tuning, user_database_path
from mhagen.records.replay import (kernel_hash, local_outputs, outputs_differ,
                                   prepared_calls, random_arguments, trace_fields, versions)
from mhagen.schedules import Plan, default_configs, schedule_kernel
from mhagen.schedules.tvmscript import import_tensor_intrinsics
from mhagen.target import resolve


@dataclass
class KernelResult:
    shape: tuple
    kernel: str
    method: str
    trials: int
    default_us: float | None
    tuned_us: float | None
    kept: str                     # "tuned" or "default"
    note: str = ""                # why nothing was measured (the device's first error)
    planned: int = 0              # the trials asked for (more than `trials`: the budget)


@dataclass
class TuneReport:
    database: Path
    results: list = field(default_factory=list)
    interrupted: bool = False
    stopped_by: str | None = None   # "Ctrl-C" or "the time budget" when interrupted
    seconds: float = 0.0
    work_dir: Path | None = None    # MetaSchedule's databases: a re-run resumes from them
    untuned: list = field(default_factory=list)   # "kernel BxS" left without a record
    budget_note: str = ""           # what the time budget stopped, in one line

    def table(self) -> str:
        rows = [f"{'shape':>10} {'kernel':<18} {'method':<12} {'trials':>6} {'default us':>11} "
                f"{'tuned us':>9} {'speedup':>7} kept"]
        for r in self.results:
            d = f"{r.default_us:.1f}" if r.default_us else "-"
            t = f"{r.tuned_us:.1f}" if r.tuned_us else "-"
            sp = f"{r.default_us / r.tuned_us:.2f}x" if (
                r.default_us and r.tuned_us) else "-"
            rows.append(f"{'x'.join(map(str, r.shape)):>10} {r.kernel:<18} {r.method:<12} "
                        f"{r.trials:>6} {d:>11} {t:>9} {sp:>7} {r.kept}")
            if r.note:
                rows.append(f"{'':>10} {r.note}")
            elif r.planned > r.trials:
                rows.append(f"{'':>10} search stopped by the time budget after {r.trials} of "
                            f"{r.planned} trials")
        rows.append("us: median time per call, the default and the best tuned schedule timed "
                    "side by side after the search (steady state, as `mhagen bench` times)")
        return "\n".join(rows)

    def summary(self) -> str:
        """The run's closing line: how it ended, and how to resume one that stopped early."""
        records = f"records in {self.database}"
        if not self.interrupted:
            return f"done in {self.seconds:.0f} s; {records}"
        lines = [f"stopped by {self.stopped_by}: kept what was measured, after "
                 f"{self.seconds:.0f} s of tuning; {records}"]
        if self.budget_note:
            lines.append(self.budget_note)
        if self.untuned:
            lines.append(f"not tuned ({len(self.untuned)}): {', '.join(self.untuned)}")
        lines.append("run the same command again to resume: trials measured so far are "
                     f"kept in {self.work_dir}")
        return "\n".join(lines)


# A tuned schedule replaces the default only when at least 3% faster (timing noise here is
# a few percent; a tie keeps the hand-written default).
KEEP_MARGIN = 0.97


def template_rows(backend) -> tuple:
    """The matmul template's tuning knob: register tile rows (columns follow the weight
    panels), from 2 up to the default's (AVX-512: 3, 6, 8, 10, 12, the 8 of the former
    default among them; AVX2: 2, 3, 4, 6). Never 1: a unit loop changes the trace's loop
    count, which MetaSchedule's mutators cannot replay."""
    top = max(2, backend.gemm_tile()[0])
    return tuple(sorted({max(2, top // 4), max(2, top // 2), max(2, 2 * top // 3),
                         max(2, top - 2), top}))


class _Stop(Exception):
    """Stops the whole run (Ctrl-C, or the time budget's deadline reached)."""


class _SearchStop(Exception):
    """Stops one kernel's search (its next batch would pass the time budget); the kernel
    is still measured and recorded with the trials it has."""


def fast_build(mod, target, _params):
    """MetaSchedule's default build without importing tensor intrinsics (fp32 needs none):
    the default re-imports them in every builder worker (~16 s each batch)."""
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock
    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm.tirx.build(mod, target=target)


def export_for_arch(mod, cxx):
    """Export a built candidate as a shared library linked here by `cxx` (another
    architecture's g++: cross-compiling)."""

    from tvm.support import cc
    path = os.path.join(tempfile.mkdtemp(), "tvm_tmp_mod.so")
    mod.export_library(path, fcompile=cc.cross_compiler(cxx))
    return path


def _search_strategy(budget):
    """MetaSchedule's evolutionary search with a population scaled to the trial budget: its
    default population (512 schedules sampled and mutated before the first measurement) is
    what 64 trials need, and made a 3-trial run of a 64-wide layer spend 94 s (Zen 3) in
    sampling alone."""
    import tvm.s_tir.meta_schedule as ms
    population = min(512, max(32, 8 * budget))
    return ms.search_strategy.EvolutionarySearch(
        population_size=population, init_min_unmeasured=min(50, population // 4))


def _other_arch_cxx(target):
    """The cross compiler (g++) that links code of another architecture here, or None (this
    machine's architecture, or none installed)."""
    arch = str(target.attrs.get("mtriple", "")).split("-")[0]
    return shutil.which(ARCHES[arch].cxx) if arch != host_arch() and arch in ARCHES else None


def _local_builder(target, **kwargs):
    """MetaSchedule's LocalBuilder with fast_build. Its default export is a .tar of objects
    that the runner's machine links with its own compiler; for code of another architecture
    (a board over RPC) link here with the cross compiler instead, as `mhagen build` does, so
    the board needs no compiler (the .tar stays when no cross compiler is installed)."""

    import tvm.s_tir.meta_schedule as ms

    cxx = _other_arch_cxx(target)
    if cxx:
        kwargs["f_export"] = functools.partial(export_for_arch, cxx=cxx)
    return ms.builder.LocalBuilder(f_build=fast_build, **kwargs)


def _built_here(funcs, target):
    """[(artifact path, None), or (None, the build error)] of each PrimFunc, built in this
    process and exported as _local_builder's workers export: our own measurements on a
    remote device (a few kernels, not a search) skip the LocalBuilder's two worker
    processes a call (each imports TVM: ~3 s), as the local ones compile here too."""
    from tvm.s_tir.meta_schedule.builder.local_builder import default_export
    cxx = _other_arch_cxx(target)
    export = functools.partial(export_for_arch, cxx=cxx) if cxx else default_export
    out = []
    for f in funcs:
        try:
            out.append((export(fast_build(tvm.IRModule({"main": f}), target, None)), None))
        except Exception as err:  # noqa: BLE001 - a kernel that does not build: not measured
            out.append((None, str(err) or type(err).__name__))
    return out


class _Budget:
    """The run's time budget (seconds for the whole command, every kernel together): a step
    (a kernel's search start, a batch of trials, the closing measurement, a config sweep)
    starts only if what such steps took so far says it ends within the budget. A step of a
    kind not yet seen has no estimate; it starts, and the deadline cuts it (cut_at_deadline)."""

    def __init__(self, seconds):
        self.seconds = seconds
        self.start = time.monotonic()
        self.deadline = self.start + seconds if seconds else None
        self.costs = {}            # step kind -> [seconds, units] measured so far
        self.refused = None        # the step the budget did not start, in words
        self.cut = None            # the step the deadline cut, in words
        self.protected = False     # a record is being written: the deadline waits for it

    def took(self, kind, seconds, units=1):
        total = self.costs.setdefault(kind, [0.0, 0])
        total[0] += seconds
        total[1] += units

    def estimate(self, kind, units=1) -> float:
        """Seconds `units` of `kind` should take (0: never measured, no estimate)."""
        seconds, measured = self.costs.get(kind, (0.0, 0))
        return seconds / measured * units if measured else 0.0

    def left(self) -> float:
        return self.deadline - time.monotonic() if self.deadline else float("inf")

    def fits(self, what, *steps) -> bool:
        """Whether the steps ((kind, units), ...) should end within the budget; when not,
        remember `what` was not started (for the stop message)."""
        need = sum(self.estimate(kind, units) for kind, units in steps)
        if need <= self.left():
            return True
        if self.refused is None:
            self.refused = (f"the deadline passed before {what}" if self.left() <= 0 else
                            f"{what} (about {need:.0f} s) would have passed it "
                            f"({self.left():.0f} s left)")
        return False

    @contextlib.contextmanager
    def cut_at_deadline(self, bar):
        """Raise _Stop in whatever runs when the deadline passes (SIGALRM; only from the main
        thread, where signals are handled: elsewhere the estimates alone hold the budget).
        Never in an import (a module cut halfway, TVM's tensor intrinsics among them, cannot
        be imported again in this process) nor while a record is written (protect): those
        finish first."""
        if self.deadline is None or threading.current_thread() is not threading.main_thread():
            yield
            return

        def expire(signum, frame):
            if self.protected or _importing(frame):
                signal.setitimer(signal.ITIMER_REAL, 0.05)   # look again when it is done
                return
            self.cut = self.cut or f"cut {bar.name or 'the run'} at the deadline"
            bar.stopped = True
            raise _Stop()

        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, max(0.001, self.left()))
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    @contextlib.contextmanager
    def protect(self):
        """Write a record whole even when the deadline passes meanwhile."""
        self.protected = True
        try:
            yield
        finally:
            self.protected = False

    def stop_line(self) -> str:
        spent = time.monotonic() - self.start
        why = self.refused or self.cut or "reached"
        return f"time budget of {self.seconds:g} s: {why}; stopped after {spent:.0f} s"


def _importing(frame) -> bool:
    """Whether Python's import machinery is among the callers of `frame`."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


class _Progress:
    """Tuning progress on a stream (stderr): per kernel, the trials done and the time; when a
    kernel is done, its default and tuned latencies as the table reports them (MetaSchedule's
    own trial timings, cold and short, are not shown: they differ from the table's). On a
    terminal one line redrawn in place; elsewhere (a pipe, a log file) one line per update,
    no carriage returns."""

    def __init__(self, enabled, total_kernels, budget, stream=None):
        self.enabled, self.total, self.budget = enabled, total_kernels, budget
        self.stream = stream if stream is not None else sys.stderr
        self.in_place = enabled and _is_terminal(self.stream)
        self.index, self.name, self.planned, self.done = 0, "", 0, 0
        self.open = False          # a line drawn in place and not yet ended
        self.stopped = False
        self.stop_requested = False   # set by Ctrl-C (_ctrl_c_stops_at_the_next_trial)

    def kernel(self, index, name, planned, done=0):
        self.index, self.name, self.planned, self.done = index, name, planned, done
        self.show()

    def trials(self, count):
        self.done += count
        self.show()

    def check(self):
        """Raise _Stop if Ctrl-C asked to stop or the time budget is spent."""
        if self.stop_requested or self.budget.left() <= 0:
            self.stopped = True
            raise _Stop()

    def _head(self):
        return f"[{self.index}/{self.total}] {self.name:<26}"

    def _clock(self):
        spent = time.monotonic() - self.budget.start
        left = f", {max(0.0, self.budget.left()):.0f} s left" if self.budget.deadline else ""
        return f"{spent:.0f} s{left}"

    def show(self):
        if not self.enabled:
            return
        if self.in_place:
            width = 24
            filled = int(width * min(self.done, self.planned) / max(self.planned, 1))
            self._write(f"\r{self._head()} [{'#' * filled}{'.' * (width - filled)}] "
                        f"{self.done:>4}/{self.planned} trials  {self._clock()}\x1b[K")
            self.open = True
        else:
            self._write(f"{self._head()} {self.done}/{self.planned} trials  {self._clock()}\n")

    def result(self, res):
        """The kernel's closing line: the numbers of its row in the table."""
        if res.default_us is None:
            what = res.note or "not measured"
        else:
            tuned = f"{res.tuned_us:.1f} us" if res.tuned_us else "-"
            what = f"default {res.default_us:.1f} us, tuned {tuned}: kept {res.kept}"
        if self.enabled:
            self._write(("\r" if self.in_place else "") + f"{self._head()} {res.trials} trials  "
                        f"{what}  {self._clock()}" + ("\x1b[K\n" if self.in_place else "\n"))
            self.open = False

    def message(self, text):
        """One line of its own (below a line drawn in place)."""
        if self.enabled:
            self._write(("\n" if self.open else "") + text + "\n")
            self.open = False

    def close(self):
        """End a line drawn in place (what is printed next starts on a line of its own)."""
        if self.open:
            self._write("\n")
            self.open = False

    def _write(self, text):
        self.stream.write(text)
        self.stream.flush()


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):   # no isatty, or closed
        return False


def _quiet_metaschedule_logging():
    """MetaSchedule re-configures its logger from the handlers it finds; a handler without a
    name (added by another library) breaks that, so drop those first."""
    logger = logging.getLogger("tvm.s_tir.meta_schedule")
    for handler in list(logger.handlers):
        if handler.get_name() is None:
            logger.removeHandler(handler)


class _Remote:
    """The RPC device of one tuning run: MetaSchedule's runner for its searches, and one
    runner, started once, for every measurement of ours (each start costs a worker process
    that imports TVM); our kernels are built in this process (_built_here)."""

    def __init__(self, rpc):
        import tvm.s_tir.meta_schedule as ms

        host, port, key = rpc
        self.ms, self._search_runner, self._measure_runner = ms, None, None
        self.config = ms.runner.RPCConfig(tracker_host=host, tracker_port=int(port),
                                          tracker_key=key, session_timeout_sec=120)

    def search_runner(self):
        if self._search_runner is None:
            self._search_runner = self.ms.runner.RPCRunner(self.config)
        return self._search_runner

    def measure_runner(self):
        if self._measure_runner is None:
            config = self.ms.runner.EvaluatorConfig(number=3, repeat=5, min_repeat_ms=50,
                                                    enable_cpu_cache_flush=False)
            self._measure_runner = self.ms.runner.RPCRunner(self.config,
                                                            evaluator_config=config)
        return self._measure_runner

    def run(self, artifact, device, args_info, fixed):
        """Submit one built kernel, its `fixed` arguments filled with real data."""
        runner = self.measure_runner()
        # MetaSchedule wraps the runner (tvm.ir.utils.derived_object); run() reads the
        # allocation function from the instance when it submits
        getattr(runner, "_inst", runner).f_alloc_argument = _alloc_with(fixed)
        return runner.run([self.ms.runner.RunnerInput(artifact, device, args_info)])[0]

    def outputs(self, funcs, target, fixed=None, seed=0):
        """([the last argument of each PrimFunc after one call on the device], None), all
        on the same arguments (random_arguments), or (None, the first error)."""
        from tvm.s_tir.meta_schedule.runner.rpc_runner import default_upload_module
        fixed = fixed if isinstance(fixed, list) else [fixed] * len(funcs)
        built = _built_here(funcs, target)
        if any(error for _, error in built):
            return None, next(error for _, error in built if error).strip().splitlines()[-1]
        try:
            session = self.config.connect_server()
            device = session.device(_device_type(target), 0)
            outs = []
            for i, (f, (path, _), fx) in enumerate(zip(funcs, built, fixed)):
                # a name of its own: the device's loader would reuse a library of one name
                name = f"mhagen-check-{time.time_ns()}-{i}-{os.path.basename(path)}"
                mod = default_upload_module(session, path, name)
                args = [tvm.runtime.tensor(a, device) for a in random_arguments(f, fx, seed)]
                mod[mod.entry_name](*args)
                outs.append(args[-1].numpy())
            return outs, None
        except Exception as err:  # noqa: BLE001 - any device failure: not checked, not kept
            return None, str(err).strip().splitlines()[-1][:300]

    def close(self):
        """Stop the runners' worker processes (none is left behind)."""
        for runner in (self._search_runner, self._measure_runner):
            if runner is not None:
                getattr(runner, "_inst", runner).pool.shutdown()


def _device_type(target) -> str:
    return "cpu" if target.kind.name == "llvm" else target.kind.name


def _measured_on(t, rpc) -> dict:
    """Where a record's latencies were measured: this machine, or the RPC device (cores:
    the target's, which some defaults depend on)."""
    if rpc is not None:
        return {"cpu": t.cpu, "model": f"RPC device {rpc[2]!r}", "target": t.name,
                "cores": t.cores}
    return {"cpu": t.cpu, "model": host_cpu_model(), "target": t.name, "cores": t.cores}


def _measure(funcs, target, remote, fixed=None, errors=None):
    """Median seconds of each PrimFunc (None: it did not build or run). Here (remote None):
    the steady-state timing the benchmark uses (compiled in this process, interleaved rounds
    of back-to-back calls, median); on a remote device: built here (_built_here), each run
    by the run's RPC runner. fixed: one {argument index: numpy array}
    per PrimFunc (or one for all) for arguments that must hold real data; errors: a list
    that gets the build and run errors."""
    if remote is None:
        return _measure_steady(funcs, target, fixed)
    import tvm.s_tir.meta_schedule as ms

    fixed = fixed if isinstance(fixed, list) else [fixed] * len(funcs)
    device = _device_type(target)
    futures = {}
    for i, (f, (path, error)) in enumerate(zip(funcs, _built_here(funcs, target))):
        if error is not None:
            if errors is not None:
                errors.append(f"build: {error}")
            continue
        futures[i] = remote.run(path, device, ms.arg_info.ArgInfo.from_prim_func(f),
                                fixed[i])
    out = [None] * len(funcs)
    for i, fut in futures.items():
        res = fut.result()
        if res.error_msg is None:
            out[i] = float(np.median([float(s) for s in res.run_secs]))
        elif errors is not None:
            errors.append(f"run on the device: {res.error_msg}")
    return out


def _failure_note(errors) -> str:
    """The first error of a measurement that produced nothing, in one line: where it failed
    (build, run on the device) and the error's last line (TVM puts the cause there)."""
    if not errors:
        return ""
    where, _, error = errors[0].partition(":")
    lines = [ln.strip() for ln in error.splitlines() if ln.strip()] or ["no message"]
    return f"not measured ({len(errors)} failure(s)); first, at {where}: {lines[-1][:300]}"


def _measure_steady(funcs, target, fixed=None, rounds=7, min_ms=50.0):
    """Median seconds per call of each PrimFunc, timed like benchmarks/bench_mha.py: warm
    buffers, interleaved rounds (one per function in turn), each round back-to-back calls
    for at least min_ms. MetaSchedule's runner times cold, short runs; its ranking can
    differ from what a user sees by 10-50% (see docs/cpus-and-tuning.md)."""
    calls = prepared_calls(funcs, target, fixed)
    samples = [[] for _ in funcs]
    for _ in range(rounds):
        for i, c in enumerate(calls):
            if c is None:
                continue
            func, args = c
            n, start = 0, time.perf_counter()
            while n < 2 or (time.perf_counter() - start) * 1e3 < min_ms:
                func(*args)
                n += 1
            samples[i].append((time.perf_counter() - start) / n)
    return [float(np.median(s)) if s else None for s in samples]


def _wrong_result(funcs, t, fixed=None, rows=None, remote=None) -> str | None:
    """Why the last PrimFunc's output (its last argument; the first `rows` rows) differs
    from the first's on the same random inputs, beyond the tolerance table; None when they
    agree. Both run where they were timed: here, or on the RPC device (`remote`). A kept
    schedule is checked so before it is recorded."""
    if remote is None:
        outs = local_outputs(funcs, t.tvm, fixed)
        if outs is None:
            return "it does not build here"
    else:
        outs, error = remote.outputs(funcs, t.tvm, fixed)
        if error:
            return f"it could not be checked on the device ({error})"
    return outputs_differ(outs[0][:rows], outs[-1][:rows])


def _alloc_with(fixed):
    """MetaSchedule's random arguments on the RPC device, with `fixed` ones overwritten by
    real data."""
    fixed = {int(k): v for k, v in (fixed or {}).items()}

    def alloc(session, device, args_info, alloc_repeat):
        from tvm.s_tir.meta_schedule.runner.rpc_runner import default_alloc_argument
        args_list = default_alloc_argument(session, device, args_info, alloc_repeat)
        for args in args_list:
            for i, arr in fixed.items():
                args[i].copyfrom(arr)
        return args_list
    return alloc


@contextlib.contextmanager
def _ctrl_c_stops_at_the_next_trial(bar):
    """Ctrl-C (SIGINT) asks the run to stop after the measurements under way, as the time
    budget does, so records and MetaSchedule's databases are written whole; a second Ctrl-C
    raises KeyboardInterrupt at once. Only from the main thread (where signals are handled)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if bar.stop_requested:
            raise KeyboardInterrupt
        bar.stop_requested = True
        sys.stderr.write(("\n" if bar.open else "") + "Ctrl-C: stopping after the "
                         "measurements under way (Ctrl-C again: at once)\n")
        bar.open = False

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _reaped_workers_without_ctrl_c():
    """TVM's builder and runner workers (popen_worker processes) are in the terminal's process
    group, so Ctrl-C reached them too: they died mid-import or mid-build printing
    KeyboardInterrupt tracebacks, and the run failed in MetaSchedule. They are started with
    SIGINT blocked in the starting thread (the mask is inherited across fork and exec; a
    Ctrl-C in that instant still reaches this process), so only this process sees Ctrl-C.
    On the way out every worker pool started inside is shut down here, in this thread: an
    interrupted build's pool was otherwise freed later by one of its own threads, whose
    __del__ printed "Exception ignored ... cannot join current thread"."""
    from tvm.support.popen_pool import PopenPoolExecutor, PopenWorker

    start, init, pools = PopenWorker._start, PopenPoolExecutor.__init__, weakref.WeakSet()

    def start_blocked(worker):
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            start(worker)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    def init_seen(pool, *args, **kwargs):
        init(pool, *args, **kwargs)
        pools.add(pool)

    PopenWorker._start, PopenPoolExecutor.__init__ = start_blocked, init_seen
    try:
        yield
    finally:
        PopenWorker._start, PopenPoolExecutor.__init__ = start, init
        for pool in list(pools):
            if not pool._shutdown:
                pool.shutdown(wait=True)


def tune(layer, target="x86", *, shapes=((1, 128),), trials: int = 64,
         time_budget: float | None = None, database=None, work_dir=None, rpc=None,
         fuse: bool = True, progress: bool = True, seed: int = 0,
         kernels=None, packed: bool = False, kv_block_size: int | None = None) -> TuneReport:
    """Tune `layer` for `target` at each (batch, seq_len) in `shapes`; write the records.

    trials: MetaSchedule trials per GEMM kernel, and at most that many candidate configs of
    the attention template (it has about 9; the default is always one); time_budget:
    seconds for the whole run, a limit: no step (a kernel's search, a batch of trials, the
    closing measurement, a config sweep) starts that the steps measured so far say would
    pass it, and one under way at the deadline is cut (in the main thread); what was
    measured is kept and the report says what the budget stopped; database: the
    records file (default: the user database that builds consult); work_dir: MetaSchedule's
    databases (default: beside the records), reused to resume; rpc: (tracker_host,
    tracker_port, device_key) to measure on a remote device; kernels: names of the kernels
    to tune (default: all tunable).
    packed, kv_block_size: which build of a decoding layer (kv_cache=) to tune, as
    mhagen.build takes them: packed=True the one built with seq_len=None (any number of new
    tokens a row; each shape is (batch, max_seq_len), measured on a call of every row adding
    max_seq_len tokens), kv_block_size=B the one reading a paged cache of blocks of B tokens
    (measured on a pool whose blocks are shuffled), or both. Their decode template gets
    records of its own (the key says packed, kv_block_size); a packed build's GEMMs take
    none (any length: the rules' schedules), a paged build's are the contiguous one's.
    Ctrl-C stops tuning and still writes what was found.
    """
    import tvm.s_tir.meta_schedule as ms


    if time_budget is not None and not (isinstance(time_budget, (int, float))
                                        and 0 < time_budget < float("inf")):
        raise InputError(f"time_budget (--time-budget) is seconds for the whole run, a "
                         f"positive number, not {time_budget!r}")
    t = resolve(target)
    backend = t.backend()   # the one backend of this run, passed down
    if rpc is None and t.arch != host_arch():
        raise TargetError(f"target {t.name} is {t.arch} code and this machine is {host_arch()}: "
                          "measure it on the device through a TVM RPC tracker "
                          "(mhagen tune --rpc-tracker HOST:PORT --device-key KEY)")
    if rpc is None and t.missing_features():   # measuring here would die of SIGILL
        raise TargetError(f"cannot tune {t.name} here: {t.cannot_run()}; or tune {t.name} on a "
                          "machine that has them (or measure there through "
                          "--rpc-tracker HOST:PORT --device-key KEY)")
    form = _decode_form(layer, packed, kv_block_size)
    if getattr(layer, "context_input", None) is not None:
        raise GraphError("tuning cross-attention layers is not supported yet (their records "
                         "would need the context's length in the key); their builds use the "
                         "default schedules")
    db_path = Path(database) if database else user_database_path(t.name)
    db = Database.load(db_path)
    work_dir = Path(work_dir) if work_dir else db_path.parent / f"{t.name}-work"
    report = TuneReport(db_path, work_dir=work_dir)
    budget = _Budget(time_budget)
    remote = _Remote(rpc) if rpc is not None else None

    plans, known, fixed = [], set(), []
    for batch, seq in shapes:
        program = lower(layer, batch, seq, t, fuse=fuse, tuning=Tuning.none(), backend=backend,
                        **form)
        if kernels is not None and PACKED_ATTENTION in kernels:
            # an any-length build of this maximum shape: its packed calls' attention
            any_length = lower(layer, batch, seq, t, fuse=fuse, tuning=Tuning.none(),
                               backend=backend, symbolic=_ANY_LENGTH)
            for k in [k for k in any_length.packed or [] if k.name == PACKED_ATTENTION]:
                known.add(k.name)
                plans.append(((batch, seq), any_length, k))
        for k in program.kernels:
            gemms = [s for s in k.stages if s.pattern in ("matmul", "packed_matmul")]
            if packed and gemms:
                # any-length GEMMs: the rules schedule them (a trace is of one shape)
                if kernels is None or k.name in kernels:
                    fixed.append(KernelResult((batch, seq), k.name, "any length", 0, None,
                                              None, "default (not tunable)"))
                continue
            fixed_by = next((how for s in gemms for key, how in (
                ("pairs", "vdpbf16ps"), ("amx", "AMX tiles")) if getattr(s.workload, key, False)), None)
            if fixed_by:
                # vdpbf16ps GEMMs (schedules/x86/bf16_dot.py), AMX ones (amx.py):
                # MetaSchedule's generic space cannot express their tensor intrinsics, so
                # they keep the template's schedule
                if kernels is None or k.name in kernels:
                    fixed.append(KernelResult((batch, seq), k.name, fixed_by, 0, None, None,
                                              "default (not tunable)"))
                continue
            if k.template in ("attention", "decode") or gemms:
                known.add(k.name)
                if kernels is None or k.name in kernels:
                    plans.append(((batch, seq), program, k))
    if kernels is not None:
        unknown = sorted(set(kernels) - known - {r.kernel for r in fixed})
        if unknown:
            raise MhagenError(f"no tunable kernel named {unknown}; this layer has "
                              f"{sorted(known)}")
    report.results.extend(fixed)
    bar = _Progress(progress, len(plans), budget)
    try:
        with _reaped_workers_without_ctrl_c(), _ctrl_c_stops_at_the_next_trial(bar), \
                budget.cut_at_deadline(bar):
            _tune_plans(plans, backend, remote, bar, layer, fuse, trials, work_dir, seed, db, rpc,
                        report)
    except (KeyboardInterrupt, _Stop):
        report.interrupted = True
    except Exception:
        # a stop raised inside MetaSchedule's callback comes back wrapped as a TVM error
        if not (bar.stopped or bar.stop_requested):
            raise
        report.interrupted = True
    finally:
        bar.close()
        if remote is not None:
            remote.close()
    report.interrupted = report.interrupted or budget.refused is not None
    if report.interrupted:
        done = {(r.kernel, r.shape) for r in report.results}
        report.untuned = [f"{k.name} {shape[0]}x{shape[1]}" for shape, _, k in plans
                          if (k.name, shape) not in done]
        by_ctrl_c = bar.stop_requested or not (bar.stopped or budget.refused)
        report.stopped_by = "Ctrl-C" if by_ctrl_c else "the time budget"
        if not by_ctrl_c:
            report.budget_note = budget.stop_line()
            bar.message(report.budget_note)
    report.seconds = time.monotonic() - budget.start
    db.save()
    return report


def _tune_plans(plans, backend, remote, bar, layer, fuse, trials, work_dir, seed, db, rpc,
                report):
    """Tune each (shape, program, kernel) of `plans` in turn; save each kernel's record. Once
    the time budget refused a step, no further kernel is started."""
    t = backend.target
    for i, (shape, program, kernel) in enumerate(plans, 1):
        key = program.key(kernel.name)
        if kernel.template:
            res = _tune_template(kernel, backend, remote, bar, i, key, shape, layer, fuse,
                                 trials)
        else:
            res = _tune_metaschedule(kernel, backend, remote, bar, i, key, trials, work_dir,
                                     seed)
        if res is None:           # the budget left no time for it
            return
        report.results.append(res[0])
        if not res[0].note:   # a kernel nothing was measured of gets no record
            res[1].update(versions())
            res[1]["measured_on"] = _measured_on(t, rpc)
            with bar.budget.protect():
                db.put(res[1])
                db.save()
        bar.result(res[0])
        if bar.budget.refused:
            return
        if i < len(plans):
            bar.check()


def _tune_metaschedule(kernel, backend, remote, bar, index, key, trials, work_dir, seed):
    t = backend.target
    import tvm.s_tir.meta_schedule as ms
    from tvm.ir.utils import derived_object

    budget = bar.budget
    name = f"{kernel.name} {key['batch']}x{key['seq']}"
    mod = tvm.IRModule({"main": kernel.prim_func})
    work = work_dir / f"{key['graph']}-{key['batch']}x{key['seq']}-{kernel.name}"
    work.mkdir(parents=True, exist_ok=True)
    ms_db = ms.database.JSONDatabase(work_dir=str(work))
    done = len(ms_db.get_all_tuning_records())
    bar.kernel(index, name, trials, done)
    stages = kernel.stages
    gemm = next(s for s in stages if s.pattern in ("matmul", "packed_matmul"))
    rule = backend.gemm_rule

    rows_space = list(template_rows(backend))

    def template(sch):
        rows = sch.sample_categorical(rows_space, [1 / len(rows_space)] * len(rows_space))
        cfg = rule.default_config(gemm.workload, t)
        rule.apply(sch, gemm, dataclasses.replace(cfg, tile_rows=rows), Plan(stages, t))
        return sch

    # the phase under way: when it (or its last batch) started, its trials left, its batch
    search = {"since": 0.0, "first": True, "left": 0, "batch": 0, "stopped": False}

    class Progress(ms.measure_callback.PyMeasureCallback):
        """After each batch of trials: the time it took, and whether the next one fits."""

        def apply(self, task_scheduler, task_id, candidates, builder_results, runner_results):
            now, count = time.monotonic(), len(runner_results)
            if search["first"]:   # the search's start (workers, sampling) and first batch
                budget.took("search start", now - search["since"])
                budget.took("first batch", now - search["since"], count)
            else:
                budget.took("trial", now - search["since"], count)
            search.update(since=now, first=False, left=search["left"] - count)
            bar.trials(count)
            bar.check()
            upcoming = min(search["batch"], search["left"])
            if upcoming > 0 and not budget.fits(
                    f"the next {upcoming} trials of {name}", *_next_trials(budget, upcoming),
                    ("closing measurement", 1)):
                search["stopped"] = True
                raise _SearchStop()

    callbacks = ms.measure_callback.MeasureCallback.create("default") + [
        derived_object(Progress)()]
    # Phase 1 (fresh runs): every knob value of our template, so the search starts from the
    # hand-written schedule's neighbourhood. Phase 2: TVM's generic space (evolutionary).
    phases = []
    if done == 0 and hasattr(rule, "apply"):   # a template rule (CPUs); GPUs: dlight's
        phases.append((ms.space_generator.ScheduleFn(template), min(len(rows_space), trials)))
    phases.append(("post-order-apply", trials - done - sum(n for _, n in phases)))
    for space, count in phases:
        if count <= 0:
            continue
        if not budget.fits(f"{name}'s search", ("search start", 1),
                           ("closing measurement", 1)):
            if done == len(ms_db.get_all_tuning_records()):
                return None       # not one trial of it: left untuned
            break
        import_tensor_intrinsics()   # (once a process)
        batch = min(16, count)
        search.update(since=time.monotonic(), first=True, left=count, batch=batch)
        _quiet_metaschedule_logging()
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # its console log; ours: stderr
                ms.tune_tir(mod, t.tvm, work_dir=str(work), max_trials_global=count,
                            num_trials_per_iter=batch, database=ms_db,
                            builder=_local_builder(t.tvm),
                            runner=remote.search_runner() if remote else "local",
                            cost_model="xgb",
                            measure_callbacks=callbacks, space=space,
                            strategy=_search_strategy(count),
                            num_tuning_cores=max(1, os.cpu_count() or 1), seed=seed)
        except Exception:
            # the budget's stop, raised in the callback, comes back wrapped as a TVM error
            if not search["stopped"]:
                raise
            break
    done = len(ms_db.get_all_tuning_records())
    if not budget.fits(f"the closing measurement of {name}", ("closing measurement", 1)):
        return None
    started = time.monotonic()
    best = ms_db.get_top_k(ms_db.commit_workload(mod), 1)
    default_func, default_decisions = schedule_kernel(kernel, t, backend=backend)
    funcs = [default_func]
    trace_json = None
    if best:
        sch = tvm.s_tir.Schedule(mod)
        best[0].trace.apply_to_schedule(sch, remove_postproc=False)
        funcs.append(sch.mod["main"])
        trace_json = plain_json(best[0].trace.as_json())
    errors = []
    times = _measure(funcs, t.tvm, remote, errors=errors)
    default_s, tuned_s = times[0], (times[1] if len(times) > 1 else None)
    keep = tuned_s is not None and default_s is not None and tuned_s < KEEP_MARGIN * default_s
    wrong = _wrong_result(funcs, t, remote=remote) if keep else None
    keep = keep and wrong is None
    budget.took("closing measurement", time.monotonic() - started)
    record = {"key": key, "kind": "trace" if keep else "default", "trials": done,
              "kernel_hash": kernel_hash(kernel.prim_func),
              "default_config": default_configs(default_decisions),
              "default_us": _us(default_s), "tuned_us": _us(tuned_s)}
    if keep:
        record["trace"] = trace_json
        record.update(trace_fields(funcs[1], trace_json))
    if wrong:
        record["rejected"] = f"the fastest schedule was not kept: {wrong}"
    return (KernelResult((key["batch"], key["seq"]), kernel.name, "metaschedule", done,
                         _us(default_s), _us(tuned_s), "tuned" if keep else "default",
                         _failure_note(errors) if default_s is None else "", trials), record)


def _next_trials(budget, count):
    """The step of `count` more trials: as the trials of later batches took, or before one
    was seen, as the first batch's did (the search's start included: an overestimate)."""
    return [("trial" if budget.estimate("trial") else "first batch", count)]


def _tune_template(kernel, backend, remote, bar, index, key, shape, layer, fuse, trials):
    """The attention (or decode) template's candidate configs (the default first, at most
    `trials` of them), each built and timed; the fastest kept if right and faster by the
    margin in a second measurement of it against the default alone. A decode step is timed
    on a cache full up to its last `seq` rows (as module.latency() times it). Under a time
    budget, as many candidates as the configs timed so far say fit (at least two)."""
    t = backend.target
    decoding = kernel.template == "decode"
    budget = bar.budget
    name = f"{kernel.name} {shape[0]}x{shape[1]}"
    rule = backend.decode if decoding else backend.attention
    candidates = rule.candidates(kernel.workload, t)[:max(2, trials)]
    planned = len(candidates)
    bar.kernel(index, name, planned)
    # two candidates, and the two timed again to confirm the faster
    if not budget.fits(f"{name}'s config sweep", ("config", 4)):
        return None
    if not budget.fits(f"the {planned} configs of {name}", ("config", planned + 2)):
        affordable = int(budget.left() / budget.estimate("config")) - 2
        candidates = candidates[:max(2, affordable)]   # then the run stops
    started = time.monotonic()
    funcs, fixed = [], []
    for cfg in candidates:
        func, args = _candidate(layer, shape, t, fuse, backend, rule, kernel, cfg, key)
        funcs.append(func)
        fixed.append(args)
    errors = []
    times = _measure(funcs, t.tvm, remote, fixed=fixed, errors=errors)
    bar.trials(len(candidates))
    best = min(range(len(candidates)), key=lambda i: times[i] if times[i] else float("inf"))
    default_s, tuned_s = times[0], times[best]
    keep = (best != 0 and tuned_s is not None and default_s is not None
            and tuned_s < KEEP_MARGIN * default_s)
    timed = len(candidates)
    if keep:
        # the fastest of many noisy medians is biased low (the winner's curse: on Zen 4 a
        # sweep of 15 kept a config 1.07x "faster" that paired runs found 1.02x slower), so
        # a fresh measurement of the two alone decides, and the record holds its times
        default_s, tuned_s = _measure([funcs[0], funcs[best]], t.tvm, remote,
                                      fixed=[fixed[0], fixed[best]], errors=errors)
        timed += 2
        keep = (tuned_s is not None and default_s is not None
                and tuned_s < KEEP_MARGIN * default_s)
    wrong = None
    if keep:   # the same inputs, each with its own block table
        wrong = _wrong_result([funcs[0], funcs[best]], t, [fixed[0], fixed[best]],
                              rows=shape[0] * shape[1], remote=remote)
        keep = wrong is None
    budget.took("config", time.monotonic() - started, timed)
    record = {"key": key, "kind": "config" if keep else "default", "trials": len(candidates),
              "config": asdict(candidates[best if keep else 0]),
              "default_config": asdict(candidates[0]),
              "default_us": _us(default_s), "tuned_us": _us(tuned_s)}
    if wrong:
        record["rejected"] = f"the fastest config was not kept: {wrong}"
    return (KernelResult(shape, kernel.name, "config sweep", len(candidates), _us(default_s),
                         _us(tuned_s), "tuned" if keep else "default",
                         _failure_note(errors) if default_s is None else "", planned), record)


PACKED_ATTENTION = "attention_varlen"
_ANY_LENGTH = {"batch": True, "seq": True}


def _decode_form(layer, packed, kv_block_size) -> dict:
    """lower()'s keywords for the build of a decoding layer that tune() was asked for
    (packed: seq_len=None; kv_block_size: a paged cache); {} for the fixed, contiguous one.
    Refused (nothing measured or written) for other layers or a packed that is no bool."""
    if not isinstance(packed, bool):
        raise InputError(f"packed is True (tune the build of seq_len=None) or False, not "
                         f"{packed!r}")
    if not packed and kv_block_size is None:
        return {}
    if getattr(layer, "cache_lens_input", None) is None:
        given = " and ".join(n for n, v in (("packed=True", packed),
                                             ("kv_block_size", kv_block_size)) if v)
        raise GraphError(f"{given} tune a decoding layer's packed or paged build; "
                         f"{getattr(layer, 'name', 'this layer')!r} keeps no K/V cache: "
                         "build it with mhagen.mha(..., kv_cache=max_len), or drop them")
    return {"symbolic": _PACKED_DECODE if packed else None, "kv_block_size": kv_block_size}


# a decoding layer built for any number of new tokens: its batch (the cache's rows) is fixed
_PACKED_DECODE = {"batch": False, "seq": True}


def _candidate(layer, shape, t, fuse, backend, rule, kernel, cfg, key):
    """(PrimFunc, {argument index: array}) of one candidate config of a template kernel:
    built with its own block table (and full key lengths, a full cache); the packed calls'
    attention specialised to a packed call of shape[0] sequences of shape[1] tokens (its
    tile table as the call's); a decoding layer's packed or paged attention (its workload
    says which build it is) specialised to the call it is timed on (_decode_call)."""
    batch, seq = shape
    w = kernel.workload
    varlen = kernel.name == PACKED_ATTENTION
    decoding = kernel.template == "decode"
    form = ({"symbolic": _PACKED_DECODE if w.packed else None,
             "kv_block_size": w.kv_block_size} if decoding
            else {"symbolic": _ANY_LENGTH if varlen else None})
    program = lower(layer, batch, seq, t, fuse=fuse, tuning=_Fixed(cfg, key), backend=backend,
                    **form)
    k = next(k for k in (program.packed if varlen else program.kernels)
             if k.name == kernel.name)
    func = rule.build(k.workload, cfg, t)
    args = {}
    blocks = next((a for a in k.args if a.startswith("blocks")), None)
    if blocks is not None:
        args[k.args.index(blocks)] = program.buffers[blocks].make(None)
    full = w.cache - seq if decoding else seq
    for i, a in enumerate(k.args):
        b = program.buffers.get(a)
        if b is not None and b.role == "input" and b.dtype == "int32":
            args[i] = np.full(batch, full, np.int32)
    if varlen:
        cu = np.arange(batch + 1) * seq
        table = tile_table(cu, cu, cfg.q_tile)
        at = {a: func.params[i] for i, a in enumerate(k.args)}
        func = func.specialize({at["batch"]: 1, at["seq"]: batch * seq,
                                at["tiles"]: tvm.tirx.decl_buffer(table.shape, "int32")})
        args[k.args.index("tiles")] = table
    if decoding and (w.packed or w.kv_block_size):
        func, call = _decode_call(func, k, batch, seq)
        args.update(call)
    return func, args


def _decode_call(func, kernel, batch, seq):
    """A packed or paged decode PrimFunc specialised to the call it is timed on, and that
    call's arrays ({argument index: array}): `batch` rows each adding `seq` tokens (packed:
    cu_seqlens 0, seq, 2 seq, ..., the call's scalars batch 1 and seq batch * seq), a paged
    cache a pool of every row's blocks up to max_len handed out shuffled (a pool that has
    served a while: each sequence's blocks scattered, the slower case)."""
    w = kernel.workload
    at = {a: func.params[i] for i, a in enumerate(kernel.args)}
    bind, args = {}, {}
    if w.packed:
        bind.update({at["batch"]: 1, at["seq"]: batch * seq})
        args[kernel.args.index("cu_seqlens")] = np.arange(batch + 1, dtype=np.int32) * seq
    if w.kv_block_size:
        per_row = -(-w.cache // w.kv_block_size)
        order = np.random.default_rng(0).permutation(batch * per_row).astype(np.int32)
        args[kernel.args.index("block_tables")] = order.reshape(batch, per_row)
        pool = (batch * per_row, w.kv_heads, w.kv_block_size, w.head_dim)
        for name in ("k_cache", "v_cache"):
            bind[at[name]] = tvm.tirx.decl_buffer(pool, w.cache_dtype, name=name)
    return func.specialize(bind), args


class _Fixed:
    """A Tuning that answers one attention (or decode) config (to lower a candidate): for
    the kernel of `key` (attention, decode, or the packed calls' attention_varlen)."""

    def __init__(self, cfg, key):
        self.record = {"key": key, "kind": "config", "config": asdict(cfg)}

    def lookup(self, key):
        return self.record if key["kernel"] == self.record["key"]["kernel"] else None


def plain_json(obj):
    """A trace's JSON (TVM containers, IntImm/FloatImm) as plain Python JSON values."""
    if obj is None or isinstance(obj, (str, int, float)):
        return obj
    if isinstance(obj, tvm.tirx.IntImm):
        return int(obj.value)
    if isinstance(obj, tvm.tirx.FloatImm):
        return float(obj.value)
    if hasattr(obj, "items"):
        return {str(k): plain_json(v) for k, v in obj.items()}
    return [plain_json(x) for x in obj]


def _us(seconds):
    return round(seconds * 1e6, 2) if seconds else None
