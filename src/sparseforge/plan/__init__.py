"""Inspector and plan: analyse a sparsity pattern, balance rows over warps, describe the kernel to generate."""
from .config import WARP, TileConfig
from .plan import (DEFAULT_LAYOUT, DTYPES, ELEMENT_BYTES, LAYOUTS, ColumnUse, GroupSketch, Plan, RowGroup, make_plan,
                   pick_vec, sketch_plan)
from .reference import check_plan, coverage, execute
from .traffic import operand_bytes

__all__ = ["DEFAULT_LAYOUT", "DTYPES", "ELEMENT_BYTES", "LAYOUTS", "WARP", "ColumnUse", "GroupSketch", "Plan",
           "RowGroup", "TileConfig", "check_plan", "coverage", "execute", "make_plan", "operand_bytes", "pick_vec",
           "sketch_plan"]
