"""Compiling ahead, side by side: the pool that nn.prebuild_layers and `sparseforge bench` both run their prebuild
jobs in (spmm.prebuild_spmm / conv.prebuild_conv2d calls, one per problem). Each problem's chooser compiles
only its short list, which keeps a few cores busy; compiling every problem's list at once, before they are
measured one by one, keeps all of them busy (ResNet-50's 17 layers on a 16-core host: 5-14 of them measured
in 60 s when each compiled its own candidates first). A job is a head start, not a result: one that fails
is named in a warning and the measuring pass compiles what it needs."""
from __future__ import annotations

import os
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


def run_prebuilds(jobs: Sequence[tuple[str, Callable[[], int]]], workers: int | None = None,
                  progress: Callable[[list], Iterable] | None = None, what: str = "problems") -> Prebuilt:
    """Run `jobs`, (label, call returning the kernels it compiled), side by side on `workers` threads (default:
    every core; ptxas runs in subprocesses, so threads suffice). progress, if given, wraps the list of
    (label, future) pairs in submission order (console.progress, say) and is iterated as they finish. A job that
    raises is counted in Prebuilt.failures and warned about once for all (`what` names the jobs there); the
    others go on. Ctrl-C drops the queued jobs (those running finish) and is raised again."""
    started = time.perf_counter()
    workers = max(1, workers or os.cpu_count() or 1)
    failures: list[str] = []

    def run(label: str, job: Callable[[], int]) -> int:
        try:
            return job()
        except Exception as exc:  # noqa: BLE001 - a head start missed, not an error: the measuring pass compiles it
            failures.append(f"{label}: {type(exc).__name__}: {str(exc)[:160]}")
            return 0

    built = 0
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending = [(label, pool.submit(run, label, job)) for label, job in jobs]
        try:
            for _, future in (progress(pending) if progress is not None else pending):
                built += future.result()
        except BaseException:  # Ctrl-C: drop the queued compiles rather than wait for them
            for _, future in pending:
                future.cancel()
            raise
    if failures:
        warnings.warn(f"prebuilding {len(failures)} of {len(jobs)} {what} failed (they compile when measured): "
                      f"{failures[0]}", stacklevel=2)
    return Prebuilt(built, len(jobs), tuple(failures), time.perf_counter() - started, workers)
