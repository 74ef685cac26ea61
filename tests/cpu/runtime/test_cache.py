
import pytest

from sparseforge.runtime import KernelCache, cache_key


def test_miss_then_hit(tmp_path):
    cache = KernelCache(tmp_path, enabled=True)
    builds = []

    def build():
        builds.append(1)
        return b"\x7fELF-cubin", {"name": "k"}

    blob, meta, hit = cache.get_or_build("ab" * 32, 90, build)
    assert (blob, hit) == (b"\x7fELF-cubin", False)
    blob, meta, hit = cache.get_or_build("ab" * 32, 90, build)
    assert hit and blob == b"\x7fELF-cubin" and meta["name"] == "k" and len(builds) == 1


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete_cubin", "bad_json"])
def test_damaged_entry_is_rebuilt(tmp_path, damage):
    cache = KernelCache(tmp_path, enabled=True)
    key = cache_key("source")
    cache.put(key, 90, b"0123456789" * 10, {"name": "k"})
    folder = next(p for p in tmp_path.rglob(key) if p.is_dir())
    cubin, meta = folder / "kernel.cubin", folder / "meta.json"
    if damage == "truncate":
        cubin.write_bytes(cubin.read_bytes()[:7])
    elif damage == "flip":
        cubin.write_bytes(b"X" + cubin.read_bytes()[1:])
    elif damage == "delete_cubin":
        cubin.unlink()
    else:
        meta.write_text("{not json")
    assert cache.get(key, 90) is None
    _, _, hit = cache.get_or_build(key, 90, lambda: (b"fresh", {}))
    assert not hit and cache.get(key, 90)[0] == b"fresh"


def test_incomplete_entry_without_meta_is_a_miss(tmp_path):
    cache = KernelCache(tmp_path, enabled=True)
    key = cache_key("x")
    cache.put(key, 90, b"blob", {})
    next(p for p in tmp_path.rglob("meta.json")).unlink()
    assert cache.get(key, 90) is None


def test_disabled_cache_stores_nothing(tmp_path):
    cache = KernelCache(tmp_path, enabled=False)
    cache.get_or_build("k" * 64, 90, lambda: (b"x", {}))
    assert not any(tmp_path.iterdir())


def test_env_moves_and_disables_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEFORGE_CACHE_DIR", str(tmp_path / "c"))
    assert KernelCache().root == tmp_path / "c"
    monkeypatch.setenv("SPARSEFORGE_NO_CACHE", "1")
    assert not KernelCache().enabled
    monkeypatch.delenv("SPARSEFORGE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert KernelCache().root == tmp_path / "xdg" / "sparseforge"


def test_tuned_records_round_trip(tmp_path):
    cache = KernelCache(tmp_path, enabled=True)
    cache.put_tuned("t" * 64, 90, {"config": {"vec": 2}})
    assert cache.get_tuned("t" * 64, 90) == {"config": {"vec": 2}}
    assert cache.get_tuned("u" * 64, 90) is None


def test_key_separates_parts():
    assert cache_key("ab", "c") != cache_key("a", "bc")
