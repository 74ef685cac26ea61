"""Compiling ahead, side by side: the pool that nn.prebuild_layers and `sparseforge bench` both run their prebuild
jobs in (spmm.prebuild_spmm / conv.prebuild_conv2d calls, one per problem). Each problem's chooser compiles
only its short list, which keeps a few cores busy; compiling every problem's list at once, before they are
measured one by one, keeps all of them busy (ResNet-50's 17 layers on a 16-core host: 5-14 of them measured
in 60 s when each compiled its own candidates first). A job is a head start, not a result: one that fails
is named in a warning and the measuring pass compiles what it needs."""
from __future__ import annotations

import os
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence


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


class PrebuildRun:
    """`jobs`, (label, call returning the kernels it compiled), all submitted at once to a pool of `workers`
    threads (default: every core; ptxas runs in subprocesses, so threads suffice). wait(i) blocks until job i
    is done, so a caller can use each result as soon as it exists (bench measures case i then: a run cut
    short keeps what it measured) while later jobs compile; finish() waits for the rest and says what was
    done. A job that raises is counted in Prebuilt.failures and warned about once for all at finish (`what`
    names the jobs there); the others go on. cancel() drops the queued jobs and stops the running ones
    before their next candidate; use it as a context manager to cancel on any exception (Ctrl-C)."""

    def __init__(self, jobs: Sequence[tuple[str, Callable[[], int]]], workers: int | None = None,
                 what: str = "problems"):
        self._started = time.perf_counter()
        self._what, self._count = what, len(jobs)
        self.workers = max(1, workers or os.cpu_count() or 1)
        self._failures: list[str] = []
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=self.workers)
        self.pending = [(label, self._pool.submit(self._run, label, job)) for label, job in jobs]

    def _run(self, label: str, job: Callable[[], int]) -> int:
        if self._stop.is_set():
            return 0
        _CURRENT.run = self
        try:
            return job()
        except Exception as exc:  # noqa: BLE001 - a head start missed, not an error: the measuring pass compiles it
            self._failures.append(f"{label}: {type(exc).__name__}: {str(exc)[:160]}")
            return 0
        finally:
            _CURRENT.run = None

    def wait(self, index: int) -> None:
        self.pending[index][1].result()

    def finish(self) -> Prebuilt:
        built = sum(future.result() for _, future in self.pending)
        self._pool.shutdown()
        if self._failures:
            warnings.warn(f"prebuilding {len(self._failures)} of {self._count} {self._what} failed (they compile "
                          f"when measured): {self._failures[0]}", stacklevel=2)
        return Prebuilt(built, self._count, tuple(self._failures), time.perf_counter() - self._started, self.workers)

    def cancel(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "PrebuildRun":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is not None:
            self.cancel()


def run_prebuilds(jobs: Sequence[tuple[str, Callable[[], int]]], workers: int | None = None,
                  progress: Callable[[list], Iterable] | None = None, what: str = "problems") -> Prebuilt:
    """Run `jobs` side by side (PrebuildRun) and wait for them all. progress, if given, wraps the list of
    (label, future) pairs in submission order (console.progress, say) and is iterated as they finish.
    Ctrl-C drops the queued jobs, stops the running ones before their next candidate, and is raised again."""
    with PrebuildRun(jobs, workers, what) as run:
        for _, future in (progress(run.pending) if progress is not None else run.pending):
            future.result()
        return run.finish()
