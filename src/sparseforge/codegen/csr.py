"""Moved to mappings/csr/render.py (its kernel family's folder); this path stays for scripts that import it."""
from ..mappings.csr.render import *  # noqa: F401,F403
