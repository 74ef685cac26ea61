"""Moved to mappings/bitmap/plan.py (its kernel family's folder); this path stays for scripts that import it."""
from ..mappings.bitmap.plan import *  # noqa: F401,F403
