"""runtime/prebuild.py: the pool nn.prebuild_layers and `sparseforge bench` run their prebuild jobs in."""
import multiprocessing
import threading
import time

import pytest

from sparseforge.runtime.prebuild import can_fork, prebuild_useful, run_prebuilds


def test_jobs_run_side_by_side_and_their_kernels_are_counted():
    both_running = threading.Barrier(2, timeout=10)  # breaks (BrokenBarrierError) unless two jobs run at once

    def job(kernels: int):
        both_running.wait()
        return kernels

    done = run_prebuilds([("a", lambda: job(2)), ("b", lambda: job(3))], workers=2)
    assert (done.built, done.jobs, done.failures, done.workers) == (5, 2, (), 2) and done.seconds >= 0


def test_a_failing_job_is_warned_about_by_label_and_the_others_count():
    def fails():
        raise OSError("No space left on device")

    with pytest.warns(UserWarning, match=r"prebuilding 1 of 3 shapes failed .*: second: OSError: No space left"):
        done = run_prebuilds([("first", lambda: 1), ("second", fails), ("third", lambda: 4)], workers=2,
                             what="shapes")
    assert done.built == 5 and done.failures == ("second: OSError: No space left on device",)


def test_progress_sees_every_job_in_submission_order_with_its_future():
    seen = []

    def progress(pending):
        for label, future in pending:
            seen.append(label)
            yield label, future
            assert future.done()  # the pool waited for it before asking for the next

    done = run_prebuilds([(str(i), lambda i=i: i) for i in range(6)], workers=3, progress=progress)
    assert seen == [str(i) for i in range(6)] and done.built == 15


def test_ctrl_c_drops_the_queued_jobs():
    ran = []

    def interrupted():
        raise KeyboardInterrupt

    def slow(i: int):
        ran.append(i)
        time.sleep(0.3)  # still running when the interrupt reaches the main thread
        return 1

    jobs = [("0", interrupted)] + [(str(i), lambda i=i: slow(i)) for i in range(1, 8)]
    with pytest.raises(KeyboardInterrupt):
        run_prebuilds(jobs, workers=1)
    assert ran in ([], [1])  # at most the job the worker had taken; the rest cancelled


def test_nothing_is_worth_prebuilding_with_the_disk_cache_off(monkeypatch):
    monkeypatch.setenv("SPARSEFORGE_NO_CACHE", "1")
    assert not prebuild_useful()


def test_a_run_hands_each_job_over_as_soon_as_it_is_done_while_later_ones_compile():
    from sparseforge.runtime.prebuild import PrebuildRun

    release = threading.Event()

    def later():
        assert release.wait(10)  # still compiling while job 0 is used
        return 2

    with PrebuildRun([("first", lambda: 1), ("later", later)], workers=2) as run:
        run.wait(0)
        assert run.pending[0][1].result() == (1, None) and not run.pending[1][1].done()
        release.set()
        run.wait(1)
        done = run.finish()
    assert (done.built, done.jobs, done.failures) == (3, 2, ())


def test_a_cancelled_run_stops_its_running_jobs_before_their_next_candidate():
    """Ctrl-C kills the ptxas running now; a job compiling a short list must not start the next one. The
    flag belongs to the run whose job a thread runs: other code sees no stop."""
    from sparseforge.runtime.prebuild import PrebuildRun, stop_requested

    started, compiled = threading.Event(), []
    cancelled = threading.Event()

    def short_list():
        started.set()
        for candidate in range(5):
            if stop_requested():
                break
            compiled.append(candidate)
            cancelled.wait(0.2) if candidate == 0 else None
        return len(compiled)

    with pytest.raises(KeyboardInterrupt):
        with PrebuildRun([("layer", short_list)], workers=1):
            assert started.wait(10)
            raise KeyboardInterrupt
    time.sleep(0.4)  # the job saw the stop after its first candidate
    assert compiled == [0] and not stop_requested()


@pytest.mark.skipif(not can_fork(), reason="forked workers need fork (Linux, macOS)")
def test_forked_workers_run_closures_in_other_processes_and_report_failures_by_label(tmp_path):
    """processes=True: the jobs (closures: nothing is pickled but an index) run in forked processes, side by
    side, where the GIL of one interpreter does not serialize them; counts and failures come back."""
    import os

    parent = os.getpid()

    def job(i: int) -> int:
        (tmp_path / f"{i}.pid").write_text(str(os.getpid()))
        deadline = time.monotonic() + 10
        while len(list(tmp_path.glob("*.pid"))) < 2:  # both jobs at once, or this times out
            if time.monotonic() > deadline:
                raise TimeoutError("the other job never ran beside this one")
            time.sleep(0.01)
        return i

    def fails():
        raise OSError("No space left on device")

    with pytest.warns(UserWarning, match=r"prebuilding 1 of 3 shapes failed .*: third: OSError: No space left"):
        done = run_prebuilds([("first", lambda: job(2)), ("second", lambda: job(3)), ("third", fails)], workers=2,
                             what="shapes", processes=True)
    assert done.built == 5 and done.failures == ("third: OSError: No space left on device",)
    pids = {int(p.read_text()) for p in tmp_path.glob("*.pid")}
    assert len(pids) == 2 and parent not in pids


@pytest.mark.skipif(not can_fork(), reason="forked workers need fork (Linux, macOS)")
def test_a_forked_worker_that_dies_is_a_missed_head_start_not_a_crash():
    import os

    with pytest.warns(UserWarning, match=r"prebuilding .* failed .*BrokenProcessPool"):
        done = run_prebuilds([("dies", lambda: os._exit(3)), ("other", lambda: 1)], workers=2, processes=True)
    assert done.jobs == 2 and any(f.startswith("dies: BrokenProcessPool") for f in done.failures)


@pytest.mark.skipif(not can_fork(), reason="forked workers need fork (Linux, macOS)")
def test_forked_workers_run_torch_cpu_ops_after_the_parent_used_its_thread_pool(monkeypatch):
    """OpenMP's pool does not survive a fork: a worker entering a parallel region the parent had used waited
    forever (a model pruned on the CPU, then converted). Workers run torch's CPU ops on one thread."""
    import torch

    from sparseforge.runtime import prebuild

    monkeypatch.setattr(prebuild, "STALL_S", 60.0)  # a regression fails in a minute, not ten
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a pool to inherit, even on a one-core runner
    try:
        x = torch.randn(4_000_000)
        for _ in range(3):
            (x * 2).sum()  # the parent's intra-op pool has run

        def job() -> int:
            return int((torch.ones(4_000_000) * 3).sum().item() == 12_000_000) + torch.get_num_threads() - 1

        done = run_prebuilds([("a", job), ("b", job), ("c", job)], workers=2, processes=True)
    finally:
        torch.set_num_threads(threads)
    assert done.built == 3 and done.failures == ()


@pytest.mark.skipif(not can_fork(), reason="forked workers need fork (Linux, macOS)")
def test_a_stalled_forked_worker_is_given_up_and_the_run_goes_on(monkeypatch):
    """No job finishing for STALL_S gives the rest up: the stalled worker killed (even one whose inherited
    SIGTERM handler would ignore a terminate), the queued jobs cancelled, each reported as given up."""
    import signal

    from sparseforge.runtime import prebuild

    monkeypatch.setattr(prebuild, "STALL_S", 1.0)
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # inherited by the forked workers
    started = time.monotonic()
    try:
        with pytest.warns(UserWarning, match=r"prebuilding 3 of 4 .* failed .*stalls: given up \(no prebuild job "
                                             r"finished in 1 s\)"):
            done = run_prebuilds([("quick", lambda: 1), ("stalls", lambda: time.sleep(3600) or 1),
                                  ("stalls too", lambda: time.sleep(3600) or 1), ("queued", lambda: 1)],
                                 workers=2, processes=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert done.built == 1 and time.monotonic() - started < 30
    deadline = time.monotonic() + 10  # the workers are gone (alive, they would hold the interpreter's exit)
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not multiprocessing.active_children()
    assert sorted(done.failures) == sorted(f"{label}: given up (no prebuild job finished in 1 s)"
                                           for label in ("queued", "stalls", "stalls too"))


@pytest.mark.skipif(not can_fork(), reason="forked workers need fork (Linux, macOS)")
def test_a_slow_job_is_not_a_stall_while_others_finish(monkeypatch):
    """The stall clock restarts whenever any job finishes: a job slower than STALL_S among ones that keep
    finishing is waited for."""
    from sparseforge.runtime import prebuild

    monkeypatch.setattr(prebuild, "STALL_S", 1.5)
    jobs = [("slow", lambda: time.sleep(2.5) or 1)] + [(f"q{i}", lambda i=i: time.sleep(0.2 * i) or 1)
                                                       for i in range(1, 12)]
    done = run_prebuilds(jobs, workers=2, processes=True)
    assert done.built == 12 and done.failures == ()


def test_threads_are_waited_for_whatever_the_stall_clock(monkeypatch):
    from sparseforge.runtime import prebuild

    monkeypatch.setattr(prebuild, "STALL_S", 0.2)
    done = run_prebuilds([("slow", lambda: time.sleep(0.6) or 1), ("other", lambda: 1)], workers=2)
    assert done.built == 2 and done.failures == ()
