"""Moved to mappings/split24/plan.py (its kernel family's folder); this path stays for scripts that import it."""
from ..mappings.split24.plan import *  # noqa: F401,F403
