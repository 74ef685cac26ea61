"""Moved to mappings/csr/plan.py (its kernel family's folder); this path stays for scripts that import it."""
from ..mappings.csr.plan import *  # noqa: F401,F403
