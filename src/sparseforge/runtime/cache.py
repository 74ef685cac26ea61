"""The disk cache of compiled kernels and tuning winners (Triton/FlashInfer style).

Layout: <cache_dir>/<sparseforge version>/sm_<arch>/<key[:2]>/<key>/{kernel.cubin, meta.json}
- key = sha256 over everything that changes the binary: generated source, arch, toolchain, options;
- writes go to a temporary folder first and are moved in with os.replace; meta.json, written last and
  holding the cubin's sha256, marks an entry complete;
- an entry whose cubin is missing, truncated or altered is removed and rebuilt, never trusted;
- a file lock per key, with a second look after taking it, so parallel processes build a key once.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from .. import env

_VERSION = "0.1.0"


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
            if hashlib.sha256(cubin).hexdigest() != meta["cubin_sha256"]:
                raise ValueError("cubin does not match its recorded hash")
        except (OSError, ValueError, KeyError, TypeError):
            shutil.rmtree(folder, ignore_errors=True)
            return None
        return cubin, meta

    def put(self, key: str, arch: int, cubin: bytes, meta: dict) -> None:
        if not self.enabled:
            return
        folder = self._folder(key, arch)
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
        try:
            (staging / "kernel.cubin").write_bytes(cubin)
            record = dict(meta, cubin_sha256=hashlib.sha256(cubin).hexdigest(), key=key)
            (staging / "meta.json").write_text(json.dumps(record, indent=1, sort_keys=True))
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(staging, folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    @contextmanager
    def lock(self, key: str, arch: int):
        if not self.enabled:
            yield
            return
        lock_dir = self.root / _VERSION / f"sm_{arch}" / "locks"
        lock_dir.mkdir(parents=True, exist_ok=True)
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

    def get_tuned(self, key: str, arch: int) -> dict | None:
        if not self.enabled:
            return None
        try:
            return json.loads(self._tune_path(key, arch).read_text())
        except (OSError, ValueError):
            return None

    def put_tuned(self, key: str, arch: int, record: dict) -> None:
        if not self.enabled:
            return
        path = self._tune_path(key, arch)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
        os.replace(tmp, path)
