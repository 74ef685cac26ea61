import json
import shutil
import warnings

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


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete_cubin", "bad_json", "older_meta"])
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
    elif damage == "older_meta":  # an entry written before the CRC-32 check: no length or CRC to verify
        record = json.loads(meta.read_text())
        meta.write_text(json.dumps({k: v for k, v in record.items() if not k.startswith("cubin_")}))
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
    cache.put_tuned("t" * 64, 90, {"config": {"vec": 2}, "records": [{"us": 3.0}]})
    assert cache.get_tuned("t" * 64, 90) == {"config": {"vec": 2}, "records": [{"us": 3.0}]}
    assert cache.get_tuned("u" * 64, 90) is None


@pytest.mark.parametrize("text", ["[1]", '{"config": {"bogus": 1}}', '{"config": [2], "records": []}',
                                  '{"config": {"vec": 2}, "records": {}}', "null", '"vec"', "{not json", "\xff"])
def test_tuned_record_of_the_wrong_shape_is_removed(tmp_path, text):
    cache = KernelCache(tmp_path, enabled=True)
    cache.put_tuned("t" * 64, 90, {"config": {}, "records": []})
    path = next(tmp_path.rglob("*.json"))
    path.write_text(text)
    assert cache.get_tuned("t" * 64, 90) is None and not path.exists()
    path.mkdir()  # a folder where the record belongs
    assert cache.get_tuned("t" * 64, 90) is None and not path.exists()
    cache.put_tuned("t" * 64, 90, {"config": {"vec": 3}, "records": []})  # field values are the caller's to check
    assert cache.get_tuned("t" * 64, 90)["config"] == {"vec": 3}


@pytest.mark.parametrize("damage", ["entry_is_a_file", "shard_is_a_file", "locks_is_a_file", "lock_is_a_folder",
                                    "meta_is_a_folder", "cubin_is_a_folder"])
def test_layout_damage_is_repaired_without_a_warning(tmp_path, damage):
    cache, key = KernelCache(tmp_path, enabled=True), cache_key("layout")
    cache.get_or_build(key, 90, lambda: (b"old", {}))
    arch_dir = tmp_path / "0.1.0" / "sm_90"
    entry = arch_dir / key[:2] / key
    target = {"entry_is_a_file": entry, "shard_is_a_file": entry.parent, "locks_is_a_file": arch_dir / "locks",
              "lock_is_a_folder": arch_dir / "locks" / f"{key}.lock", "meta_is_a_folder": entry / "meta.json",
              "cubin_is_a_folder": entry / "kernel.cubin"}[damage]
    if damage.startswith("lock"):
        shutil.rmtree(entry)  # a miss, so the build goes through the lock
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    target.mkdir() if damage.endswith("folder") else target.write_text("in the way")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        blob, _, hit = cache.get_or_build(key, 90, lambda: (b"new", {}))
        assert (blob, hit) == (b"new", False)
        blob, _, hit = cache.get_or_build(key, 90, lambda: (b"again", {}))
        assert (blob, hit) == (b"new", True)


def test_a_file_as_the_cache_root_bypasses_the_cache_with_one_warning(tmp_path):
    root = tmp_path / "cache"
    root.write_text("not a folder")
    with pytest.warns(RuntimeWarning, match="is unusable") as caught:
        for _ in range(3):  # compile_spmm makes a KernelCache per call
            blob, _, hit = KernelCache(root, enabled=True).get_or_build(cache_key("r"), 90, lambda: (b"k", {}))
            assert (blob, hit) == (b"k", False)
        KernelCache(root, enabled=True).put_tuned("t" * 64, 90, {"config": {}, "records": []})
        assert KernelCache(root, enabled=True).get_tuned("t" * 64, 90) is None
    assert len(caught) == 1 and root.read_text() == "not a folder"


def test_key_separates_parts():
    assert cache_key("ab", "c") != cache_key("a", "bc")
