"""Moved to mappings/tile/autotune.py (its kernel family's folder); this path stays for scripts that import it."""
from ..mappings.tile.autotune import *  # noqa: F401,F403
