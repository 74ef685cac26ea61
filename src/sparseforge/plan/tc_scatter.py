"""Moved to mappings/tc_scatter/plan.py (its kernel family's folder); this path stays for scripts that import it."""
from ..mappings.tc_scatter.plan import *  # noqa: F401,F403
