"""Moved to mappings/bitmap/render.py (its kernel family's folder); this path stays for scripts that import it."""
from ..mappings.bitmap.render import *  # noqa: F401,F403
