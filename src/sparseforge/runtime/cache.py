"""The disk cache of compiled kernels and tuning winners (Triton/FlashInfer style).

Layout: <cache_dir>/<sparseforge version>/sm_<arch>/<key[:2]>/<key>/{kernel.cubin, meta.json}
- key = sha256 over everything that changes the binary: generated source, arch, toolchain, options;
- writes go to a temporary folder first and are moved in with os.replace; meta.json, written last and
  holding the cubin's length and CRC-32, marks an entry complete (CRC-32, not a cryptographic hash: it
  guards against truncation and bit rot, not tampering, and costs ~0.2 ms per MB on every cache hit where
  sha256 cost ~0.6, a third of a warm compile_spmm for a 3 MB cubin);
- an entry whose cubin is missing, truncated or altered is removed and rebuilt, never trusted;
- a file lock per key, with a second look after taking it, so parallel processes build a key once;
- a file where a folder of the layout belongs (or a folder where a file does) is removed and rebuilt; a root
  that cannot hold the folders (a file, say) turns the disk cache off with one warning: kernels still build;
- a tuning record of the wrong shape is removed and None returned, so the caller tunes again.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import warnings
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from .. import env

from .._version import __version__ as _VERSION
_WARNED_ROOTS: set[Path] = set()  # one warning per unusable root and process, not one per kernel


def _remove(path: Path) -> None:
    """Remove whatever sits at path (folder, file or link), ignoring what is already gone."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


def _is_tuning_record(record) -> bool:
    return (isinstance(record, dict) and isinstance(record.get("config"), dict)
            and isinstance(record.get("records"), list))


def cache_key(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


class KernelCache:
    def __init__(self, root: Path | None = None, enabled: bool | None = None):
        self.enabled = env.disk_cache_enabled() if enabled is None else enabled
        self.root = Path(root) if root is not None else env.cache_dir()

    def _folder(self, key: str, arch: int) -> Path:
        return self.root / _VERSION / f"sm_{arch}" / key[:2] / key

    def _make_dirs(self, folder: Path) -> bool:
        """Create folder below the root, replacing a file that sits where one of its folders belongs. False,
        after turning the disk cache off with one warning, when the root itself cannot hold them."""
        try:
            folder.mkdir(parents=True, exist_ok=True)
            return True
        except (FileExistsError, NotADirectoryError):  # a file in the way; the root itself is never removed
            for part in [*(p for p in reversed(folder.parents) if self.root in p.parents), folder]:
                if not part.is_dir():
                    _remove(part)
        except OSError:
            pass
        try:
            if self.root.is_dir():
                folder.mkdir(parents=True, exist_ok=True)
                return True
        except OSError:
            pass
        self.enabled = False
        if self.root not in _WARNED_ROOTS:
            _WARNED_ROOTS.add(self.root)
            warnings.warn(f"kernel cache {self.root} is unusable (not a writable directory): kernels are built "
                          "without the disk cache; remove it or point SPARSEFORGE_CACHE_DIR elsewhere",
                          RuntimeWarning)
        return False

    def get(self, key: str, arch: int) -> tuple[bytes, dict] | None:
        """The cached (cubin, meta), or None when absent or damaged (a damaged entry is removed)."""
        if not self.enabled:
            return None
        folder = self._folder(key, arch)
        meta_path, cubin_path = folder / "meta.json", folder / "kernel.cubin"
        if not meta_path.is_file():
            return None
        try:
            meta = json.loads(meta_path.read_text())
            cubin = cubin_path.read_bytes()
            if len(cubin) != meta["cubin_bytes"] or zlib.crc32(cubin) != meta["cubin_crc32"]:
                raise ValueError("cubin does not match its recorded length and CRC-32")
        except (OSError, ValueError, KeyError, TypeError):
            shutil.rmtree(folder, ignore_errors=True)
            return None
        return cubin, meta

    def put(self, key: str, arch: int, cubin: bytes, meta: dict) -> None:
        if not self.enabled:
            return
        folder = self._folder(key, arch)
        if not self._make_dirs(folder.parent):
            return
        staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
        try:
            (staging / "kernel.cubin").write_bytes(cubin)
            record = dict(meta, cubin_bytes=len(cubin), cubin_crc32=zlib.crc32(cubin), key=key)
            (staging / "meta.json").write_text(json.dumps(record, indent=1, sort_keys=True))
            _remove(folder)  # a damaged entry, or a file where the entry's folder belongs
            os.replace(staging, folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    @contextmanager
    def lock(self, key: str, arch: int):
        if not self.enabled:
            yield
            return
        lock_dir = self.root / _VERSION / f"sm_{arch}" / "locks"
        if not self._make_dirs(lock_dir):
            yield
            return
        if (lock_dir / f"{key}.lock").is_dir():
            _remove(lock_dir / f"{key}.lock")
        with open(lock_dir / f"{key}.lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def get_or_build(self, key: str, arch: int, build: Callable[[], tuple[bytes, dict]]
                     ) -> tuple[bytes, dict, bool]:
        """(cubin, meta, hit): from the cache, or built once under the key's lock and stored."""
        found = self.get(key, arch)
        if found:
            return (*found, True)
        with self.lock(key, arch):
            found = self.get(key, arch)  # another process may have built it while we waited
            if found:
                return (*found, True)
            cubin, meta = build()
            self.put(key, arch, cubin, meta)
            return cubin, meta, False

    # -- tuning winners ------------------------------------------------------------------------
    def _tune_path(self, key: str, arch: int) -> Path:
        return self.root / _VERSION / f"sm_{arch}" / "tune" / f"{key}.json"

    def get_tuned(self, key: str, arch: int, valid: Callable[[object], bool] = _is_tuning_record) -> dict | None:
        """The stored winner: a dict with a "config" dict and a "records" list (or what `valid` accepts, for
        other decisions kept alike), or None. A file of any other shape (or not JSON) is removed, so the
        caller decides again. The config's fields are the caller's to check (TileConfig validates itself)."""
        if not self.enabled:
            return None
        path = self._tune_path(key, arch)
        try:
            record = json.loads(path.read_text())
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (OSError, ValueError):
            record = None
        if valid(record):
            return record
        _remove(path)
        return None

    def put_tuned(self, key: str, arch: int, record: dict) -> None:
        if not self.enabled:
            return
        path = self._tune_path(key, arch)
        if not self._make_dirs(path.parent):
            return
        if path.is_dir():
            _remove(path)
        handle, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=path.parent)  # per writer, threads too
        with os.fdopen(handle, "w") as f:
            f.write(json.dumps(record, indent=1, sort_keys=True))
        os.replace(tmp, path)
