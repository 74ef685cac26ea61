"""Compiling ahead, side by side: the pool that nn.prebuild_layers and `sparseforge bench` both run their prebuild
jobs in (spmm.prebuild_spmm / conv.prebuild_conv2d calls, one per problem). Each problem's chooser compiles
only its short list, which keeps a few cores busy; compiling every problem's list at once, before they are
measured one by one, keeps all of them busy (ResNet-50's 17 layers on a 16-core host: 5-14 of them measured
in 60 s when each compiled its own candidates first). A job is a head start, not a result: one that fails
is named in a warning and the measuring pass compiles what it needs.

Threads or processes: ptxas runs in subprocesses either way, but planning and rendering a generated kernel is
Python and holds the GIL, so on many cores threads leave the jobs waiting on one interpreter (ResNet-50 on 16
cores: 222 s of a 261 s cold conversion in the prebuild, against ptxas's few seconds). processes=True forks
the workers: each inherits the job list and is sent only an index, so a job need not pickle (a closure is
fine), only its result (an int) comes back, and the CUDA context is never touched there (the jobs make no
CUDA call: they plan, render and run ptxas), as PyTorch's DataLoader workers are forked. Like those, a
worker runs torch's CPU ops on one thread: OpenMP's thread pool does not survive a fork, and a child entering a
parallel region after the parent used the pool waits forever (a conversion of a model pruned on the CPU hung
so). Should forked workers stall anyway, STALL_S with no job finished gives the rest up (the workers killed):
the measuring pass compiles what it needs. Threads cannot be stopped, and cannot meet that stall: they are
waited for."""
from __future__ import annotations

import itertools
import multiprocessing
import threading
import time
import warnings
from concurrent import futures
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from .. import env

STALL_S = 600.0  # seconds with no prebuild job finished, after which the rest are given up as stalled


@dataclass(frozen=True)
class Prebuilt:
    """What run_prebuilds did."""
    built: int                    # kernels compiled now (those found in the disk cache not counted)
    jobs: int                     # prebuild jobs run (problems)
    failures: tuple[str, ...]     # "label: Error: message" of each job that raised
    seconds: float                # wall time, pool start to the last job done
    workers: int                  # threads the jobs ran on


def prebuild_useful() -> bool:
    """Whether compiling now carries over to the measuring pass: only through the disk cache, and only with the
    toolkit's ptxas (without it the driver's JIT compiles on the GPU, one kernel at a time, and keeps nothing
    on disk)."""
    from .. import env
    from .compiler import PtxasCompiler

    return env.disk_cache_enabled() and PtxasCompiler.available() is not None


_CURRENT = threading.local()  # .run: the PrebuildRun whose job this pool thread is running


def stop_requested() -> bool:
    """Whether the prebuild this thread is a job of was cancelled (Ctrl-C): a job compiling a short list stops
    before its next candidate (a SIGINT kills the ptxas running now; without this the job would start the
    next one). False outside a PrebuildRun's jobs (a direct prebuild_spmm call)."""
    run = getattr(_CURRENT, "run", None)
    return run is not None and run._stop.is_set()


def _attempt(label: str, job: Callable[[], int]) -> tuple[int, str | None]:
    """(kernels built, None) or (0, "label: Error: message"): a job's outcome as either pool returns it."""
    try:
        return job(), None
    except Exception as exc:  # noqa: BLE001 - a head start missed, not an error: the measuring pass compiles it
        return 0, f"{label}: {type(exc).__name__}: {str(exc)[:160]}"


# run number -> its jobs, for forked workers to find by index (set before the pool forks, dropped at finish)
_FORKED_JOBS: dict[int, Sequence[tuple[str, Callable[[], int]]]] = {}
_run_numbers = itertools.count()


def _run_forked(run: int, index: int) -> tuple[int, str | None]:
    return _attempt(*_FORKED_JOBS[run][index])


def _one_thread_in_worker() -> None:
    """A forked worker's start: torch's CPU ops on one thread (the parent's OpenMP pool is not the child's)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def _done(future) -> None:
    """Wait for a job; a failure is its outcome, but a KeyboardInterrupt (Ctrl-C in a thread's job) is raised."""
    futures.wait([future])
    error = future.exception()
    if error is not None and not isinstance(error, Exception):
        raise error


def can_fork() -> bool:
    """Whether worker processes can be forked here (Linux, macOS; not Windows)."""
    return "fork" in multiprocessing.get_all_start_methods()


class PrebuildRun:
    """`jobs`, (label, call returning the kernels it compiled), all submitted at once to a pool of `workers`
    (default: every core), threads, or with processes=True forked processes (the module docstring says when
    and why; without fork, threads). wait(i) blocks until job i is done, so a caller can use each result as
    soon as it exists (bench measures case i then: a run cut short keeps what it measured) while later jobs
    compile; finish() waits for the rest and says what was done. A job that raises is counted in
    Prebuilt.failures and warned about once for all at finish (`what` names the jobs there); the others go on.
    cancel() drops the queued jobs and stops running threads' jobs before their next candidate (a forked
    worker finishes its job; Ctrl-C reaches it too); use it as a context manager to cancel on any exception."""

    def __init__(self, jobs: Sequence[tuple[str, Callable[[], int]]], workers: int | None = None,
                 what: str = "problems", processes: bool = False):
        self._started = time.perf_counter()
        self._what, self._count = what, len(jobs)
        self.workers = max(1, min(workers or env.cpu_cores(), max(1, len(jobs))))
        self._stop = threading.Event()
        self._stalled: str | None = None  # why the jobs left were given up (no job finished for STALL_S)
        self._given_up: set[int] = set()  # id() of the futures not done when the run was given up
        self._progress_at, self._seen_done = time.monotonic(), 0  # when a job was last seen finishing; how many
        self._number = None
        if processes and can_fork() and len(jobs) > 1:
            self._number = next(_run_numbers)
            _FORKED_JOBS[self._number] = list(jobs)
            self._pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=multiprocessing.get_context("fork"),
                                             initializer=_one_thread_in_worker)
            with warnings.catch_warnings():  # Python 3.12 warns of fork in a threaded process: the jobs take no lock
                warnings.filterwarnings("ignore", message=".*use of fork\\(\\) may lead to deadlocks",
                                        category=DeprecationWarning)
                self.pending = [(label, self._pool.submit(_run_forked, self._number, i))
                                for i, (label, _) in enumerate(jobs)]
        else:
            self._pool = ThreadPoolExecutor(max_workers=self.workers)
            self.pending = [(label, self._pool.submit(self._run, label, job)) for label, job in jobs]

    @property
    def processes(self) -> bool:
        return self._number is not None

    def _run(self, label: str, job: Callable[[], int]) -> tuple[int, str | None]:
        if self._stop.is_set():
            return 0, None
        _CURRENT.run = self
        try:
            return _attempt(label, job)
        finally:
            _CURRENT.run = None

    def wait(self, index: int) -> None:
        """Block until job `index` is done (its outcome, failed or not, is finish's to report); with forked
        workers, or until STALL_S pass with no job finished (then the run is given up, and this and later waits
        return at once)."""
        target = self.pending[index][1]
        if not self.processes:
            _done(target)
            return
        while self._stalled is None and not target.done():
            finished = sum(future.done() for _, future in self.pending)
            if finished != self._seen_done:  # a job finished since the last look (maybe between two waits)
                self._progress_at, self._seen_done = time.monotonic(), finished
            left = self._progress_at + STALL_S - time.monotonic()
            if left <= 0:
                self.give_up(f"no prebuild job finished in {STALL_S:.0f} s")
                return
            futures.wait([future for _, future in self.pending if not future.done()], timeout=left,
                         return_when=futures.FIRST_COMPLETED)
        if self._stalled is None:
            _done(target)

    def give_up(self, why: str) -> None:
        """Drop the jobs not done: queued ones cancelled, forked workers killed (a stalled one never returns, and
        SIGKILL cannot be caught), running threads told to stop before their next candidate. finish() reports
        each of them as given up."""
        self._stalled = why
        self._given_up = {id(future) for _, future in self.pending if not future.done()}
        self._stop.set()
        workers = getattr(self._pool, "_processes", None) or {}  # ProcessPoolExecutor's own (3.14: kill_workers)
        for process in list(workers.values()):
            process.kill()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _outcome(self, label: str, future) -> tuple[int, str | None]:
        if id(future) in self._given_up:  # whatever the pool made of it since (broken, cancelled)
            return 0, f"{label}: given up ({self._stalled})"
        try:
            return future.result()
        except Exception as exc:  # noqa: BLE001 - a worker process that died (BrokenProcessPool): a missed head start
            return 0, f"{label}: {type(exc).__name__}: {str(exc)[:160]}"

    def finish(self) -> Prebuilt:
        outcomes = [self._outcome(label, future) for label, future in self.pending]
        self._pool.shutdown(wait=self._stalled is None)
        self._forget()
        built = sum(count for count, _ in outcomes)
        self._failures = [failure for _, failure in outcomes if failure is not None]
        if self._failures:
            warnings.warn(f"prebuilding {len(self._failures)} of {self._count} {self._what} failed (they compile "
                          f"when measured): {self._failures[0]}", stacklevel=2)
        return Prebuilt(built, self._count, tuple(self._failures), time.perf_counter() - self._started, self.workers)

    def cancel(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._forget()

    def _forget(self) -> None:
        if self._number is not None:
            _FORKED_JOBS.pop(self._number, None)

    def __enter__(self) -> "PrebuildRun":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is not None:
            self.cancel()


def run_prebuilds(jobs: Sequence[tuple[str, Callable[[], int]]], workers: int | None = None,
                  progress: Callable[[list], Iterable] | None = None, what: str = "problems",
                  processes: bool = False) -> Prebuilt:
    """Run `jobs` side by side (PrebuildRun; processes: forked workers) and wait for them all. progress, if
    given, wraps the list of (label, future) pairs in submission order (console.progress, say) and is iterated
    as they finish. Ctrl-C drops the queued jobs, stops the running ones before their next candidate, and is
    raised again."""
    with PrebuildRun(jobs, workers, what, processes) as run:
        for index, _ in enumerate(progress(run.pending) if progress is not None else run.pending):
            run.wait(index)
        return run.finish()
