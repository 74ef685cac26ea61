"""Several processes asking for one key at once build it once and all read the same bytes."""
import multiprocessing as mp
import time

from sparseforge.runtime import KernelCache


def _worker(root, counter, results):
    cache = KernelCache(root, enabled=True)

    def build():
        with open(counter, "a") as f:
            f.write("x")
        time.sleep(0.3)
        return b"the-cubin", {"name": "k"}

    blob, _, _ = cache.get_or_build("c" * 64, 90, build)
    results.put(blob)


def test_parallel_builders_build_once(tmp_path):
    counter = tmp_path / "builds"
    results = mp.get_context("fork").Queue()
    procs = [mp.get_context("fork").Process(target=_worker, args=(tmp_path / "cache", counter, results))
             for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert all(p.exitcode == 0 for p in procs)
    assert [results.get(timeout=5) for _ in procs] == [b"the-cubin"] * 4
    assert counter.read_text() == "x"
