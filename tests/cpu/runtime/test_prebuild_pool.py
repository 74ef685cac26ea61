"""runtime/prebuild.py: the pool nn.prebuild_layers and `sparseforge bench` run their prebuild jobs in."""
import threading
import time

import pytest

from sparseforge.runtime.prebuild import prebuild_useful, run_prebuilds


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
