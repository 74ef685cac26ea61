"""Choosing kernels: the design space (space.py, autotune.py), the cost model (cost.py) and the chooser
(choose.py) that ranks, times and caches."""
from ..mappings.tile.autotune import candidates, default_config
from .choose import MIN_SPEEDUP, Choice, choose, fastest_with_margin, rank, shortlist
from .space import search_space

__all__ = ["MIN_SPEEDUP", "Choice", "candidates", "choose", "default_config", "fastest_with_margin", "rank",
           "search_space", "shortlist"]
