"""Every environment knob sparseforge reads, in one place.

SPARSEFORGE_CACHE_DIR    where compiled kernels and tuning winners live
                         (default: $XDG_CACHE_HOME/sparseforge, else ~/.cache/sparseforge)
SPARSEFORGE_NO_CACHE     "1" disables the disk cache (kernels are still cached in-process)
SPARSEFORGE_DUMP_SOURCE  a directory: every generated kernel source is also written there
"""
from __future__ import annotations

import os
from pathlib import Path


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def cache_dir() -> Path:
    explicit = os.environ.get("SPARSEFORGE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "sparseforge"


def disk_cache_enabled() -> bool:
    return not _flag("SPARSEFORGE_NO_CACHE")


def dump_source_dir() -> Path | None:
    value = os.environ.get("SPARSEFORGE_DUMP_SOURCE")
    return Path(value).expanduser() if value else None


def cpu_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container or taskset narrows), not the
    host's count: what compiles side by side, and what a tuning budget's compile estimate is shared over."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity call on this platform
        return os.cpu_count() or 1
