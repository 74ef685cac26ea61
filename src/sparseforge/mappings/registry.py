"""The kernel families: one record each, the one place that lists them. Every dispatch point (planning,
rendering, the cost model, the design space, the CPU reference, operand bytes, cached choices, the
convolution's config checks) asks this registry instead of testing a config's or a plan's class.

A record names its hooks as dotted paths ("package.module:function"), resolved on first use, so this
module imports no pipeline stage and a family's code loads only when it is asked for. A new family is its
folder under mappings/ and one registration line below.

Hook signatures (every family alike; None where the family has no such part):
- plan(w, n, dtype, layout, config, bias, relu, arch[, residual=True]) -> plan; conv families:
  plan(w, geometry, dtype, config, bias, relu, residual, arch, sketch) -> plan;
- sketch: as plan, the plan as counts only (ranking a large layer's candidates without building it);
- render(plan) -> KernelSource (None: a composite that generates nothing of its own);
- estimate(plan, batch, gpu) -> tune.cost.Estimate;
- candidates(n, layout, m, row_nnz, relu, dtype, sms) -> configs the chooser weighs; conv families:
  candidates(geometry, w, relu);
- trials: as candidates, the configs not yet timed on a GPU (in the space only with unmeasured=True);
- dense_writer(plan) -> plan: a plan over the same arrays whose kernel writes W dense into its output (M x K,
  zeroed), densify's fast path on a GPU (the runtime builds and launches it with the kernel's own arrays);
- gated(gate_plan, gate_arrays, up_plan, up_arrays) -> plan: the Llama MLP's gate and up projections in one
  kernel, silu(G X) * (U X), over the two kernels' own device arrays (nothing copied: runtime
  compile_gated_mlp);
- format_fields: the config fields that change W's arrays; configs of one family equal in them share one
  packing of W (a decoder layer's widths can then hold W once: nn/llm.py);
- execute(plan, b) -> float64 result on the CPU (conv families: execute(plan, x, residual=None));
- operand_bytes(plan) -> {"fetched_bytes", "floor_bytes"}: what the kernel moves and the floor;
- compile_seconds(config, nnz) -> predicted cold compile (None: it does not grow with W);
- check(config): ValueError naming what this family refuses in the config (conv families).
- verify(plan, w): AssertionError unless the plan covers W's nonzeros exactly once (families whose code
  holds W's values; None where W is data the kernel reads as given).
- densify(plan, arrays, out): W written dense into `out` (M x K, on the arrays' device) from the device arrays
  the kernel reads (runtime.kernel.weight_data), so a dense call needs no other copy of W (families whose
  arrays hold W).
- device_plan(w: formats.DeviceCsr, n, dtype, layout, config, bias, relu, arch[, residual=True]) -> plan:
  as plan, with W's arrays packed by torch ops on W's device and kept there (families whose W is data);
  a layer whose CSR is on the GPU then builds a kernel with no nonzero crossing to the host.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import lru_cache

SPMM, CONV = "spmm", "conv"


@dataclass(frozen=True)
class Family:
    name: str              # the family's name; cached choices record its configs under `record_name`
    kind: str              # SPMM (C = W B / Y = X W^T) or CONV (a direct sparse Conv2d)
    config: str            # the config class (dotted path)
    plan_class: str        # the plan class its plan maker returns (with config, names the family of a plan)
    plan: str              # plan maker
    render: str | None     # plan -> KernelSource; None: a composite (split-24) generates nothing itself
    estimate: str          # the cost model's time of a plan
    candidates: str | None  # its part of the design space (None: proposed by another family's space)
    execute: str | None    # the CPU reference run of a plan (None: not run on a CPU)
    operand_bytes: str | None  # bytes the kernel moves and their floor
    residual: bool = False  # the epilogue adds a residual R (C = W B + bias + R before ReLU)
    proposed: bool = True  # in the default design space (False: only with unmeasured=True, until measured)
    sketch: str | None = None  # plan maker of a counts-only plan, for ranking
    compile_seconds: str | None = None  # predicted cold compile, where it grows with W's nonzeros
    check: str | None = None  # refuses configs this family cannot take
    record_name: str = ""  # the name a cached choice records the config under ("" : name)
    weight_in_code: bool = False  # W's values are immediates of the code (False: data the runtime passes)
    verify: str | None = None  # checks a plan covers W's nonzeros exactly once (where the code holds them)
    densify: str | None = None  # W dense from the kernel's own device arrays (where they hold W)
    device_plan: str | None = None  # the plan with W's arrays packed on W's device (formats.DeviceCsr)
    trials: str | None = None  # configs not yet timed on a GPU: proposed only with unmeasured=True
    format_fields: tuple[str, ...] = ()  # config fields that change W's arrays (else one packing serves all)
    dense_writer: str | None = None  # the plan of a kernel writing W dense from the same arrays (densify's fast path)
    gated: str | None = None  # the plan of silu(G X) * (U X) in one kernel over two kernels' arrays

    @property
    def choice_name(self) -> str:
        return self.record_name or self.name

    def hook(self, part: str):
        """The callable a part names (resolved and memoised), or None where the family has no such part."""
        path = getattr(self, part)
        return None if path is None else resolve(path)

    @property
    def config_class(self) -> type:
        return resolve(self.config)


@lru_cache(maxsize=None)
def resolve(path: str):
    """The object a "package.module:attribute" path names."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


_P = "sparseforge."
_BITMAP = _P + "mappings.bitmap."
_TC = _P + "mappings.tc_scatter."
_DR = _P + "mappings.delta_runs."
_BTC = _P + "mappings.bitmap_tc."
_SPLIT24 = _P + "mappings.split24."
_CSR = _P + "mappings.csr."
_TILE = _P + "mappings.tile."
FAMILIES: tuple[Family, ...] = (
    # SpMM families, in the order their candidates join the design space
    Family("tile", SPMM, _P + "plan.config:TileConfig", _P + "plan.plan:Plan", _P + "plan.plan:make_plan",
           _P + "codegen.ptx:render", _TILE + "cost:groups_estimate", _TILE + "space:tile_candidates",
           _P + "plan.reference:execute", _P + "plan.traffic:tile_traffic", sketch=_P + "plan.plan:sketch_plan",
           compile_seconds=_TILE + "cost:tile_config_compile_seconds", weight_in_code=True,
           verify=_P + "plan.reference:check_plan"),
    Family("csr-columns", SPMM, _CSR + "plan:CsrColumnsConfig", _CSR + "plan:CsrPlan", _CSR + "plan:make_csr_plan",
           _CSR + "render:render_csr_columns", _CSR + "cost:csr_columns_estimate", _CSR + "space:csr_columns_candidates",
           _CSR + "plan:execute_csr", _CSR + "plan:csr_traffic", residual=True, densify=_CSR + "plan:densify_csr",
           device_plan=_CSR + "plan:make_csr_plan_on_device"),
    Family("csr", SPMM, _CSR + "plan:CsrConfig", _CSR + "plan:CsrPlan", _CSR + "plan:make_csr_plan",
           _CSR + "render:render_csr", _CSR + "cost:csr_estimate", _CSR + "space:csr_candidates",
           _CSR + "plan:execute_csr", _CSR + "plan:csr_traffic", residual=True, densify=_CSR + "plan:densify_csr",
           device_plan=_CSR + "plan:make_csr_plan_on_device"),
    Family("tc-scatter", SPMM, _TC + "plan:TcScatterConfig", _TC + "plan:TcScatterPlan",
           _TC + "plan:make_tc_scatter_plan", _TC + "render:render_tc_scatter", _TC + "cost:tc_scatter_estimate",
           _TC + "space:tc_scatter_candidates", _TC + "plan:execute_tc_scatter", _TC + "plan:tc_scatter_traffic",
           residual=True, densify=_TC + "plan:densify_tc_scatter",
           device_plan=_TC + "plan:make_tc_scatter_plan_on_device", trials=_TC + "space:tc_scatter_trials"),
    Family("delta-runs", SPMM, _DR + "plan:DeltaRunsConfig", _DR + "plan:DeltaRunsPlan",
           _DR + "plan:make_delta_runs_plan", _DR + "render:render_delta_runs", _DR + "cost:delta_runs_estimate",
           _DR + "space:delta_runs_candidates", _DR + "plan:execute_delta_runs", _DR + "plan:delta_runs_traffic",
           residual=True, densify=_DR + "plan:densify_delta_runs",
           device_plan=_DR + "plan:make_delta_runs_plan_on_device",
           format_fields=("gap_bits",), dense_writer=_DR + "plan:dense_writer_plan",
           gated=_DR + "plan:gated_delta_runs_plan"),
    Family("bitmap-tc", SPMM, _BTC + "plan:BitmapTcConfig", _BTC + "plan:BitmapTcPlan",
           _BTC + "plan:make_bitmap_tc_plan", _BTC + "render:render_bitmap_tc", _BTC + "cost:bitmap_tc_estimate",
           _BTC + "space:bitmap_tc_candidates", _BTC + "plan:execute_bitmap_tc", _BTC + "plan:bitmap_tc_traffic",
           residual=True, densify=_BTC + "plan:densify_bitmap_tc", device_plan=_BTC + "plan:make_bitmap_tc_plan_on_device",
           trials=_BTC + "space:bitmap_tc_trials", gated=_BTC + "plan:gated_bitmap_tc_plan"),
    Family("bitmap", SPMM, _BITMAP + "plan:BitmapConfig", _BITMAP + "plan:BitmapPlan", _BITMAP + "plan:make_bitmap_plan",
           _BITMAP + "render:render_bitmap", _BITMAP + "cost:bitmap_estimate", _BITMAP + "space:bitmap_candidates",
           _BITMAP + "plan:execute_bitmap", _BITMAP + "plan:bitmap_traffic", residual=True, proposed=False),
    Family("split-24", SPMM, _SPLIT24 + "plan:Split24Config", _SPLIT24 + "plan:Split24Plan",
           _SPLIT24 + "plan:make_split24_plan", None, _SPLIT24 + "cost:split24_estimate",
           _SPLIT24 + "space:split24_candidates", None, _SPLIT24 + "plan:split24_traffic", proposed=False),
    # convolution families, in the order their candidates join the convolution's space
    Family("conv-csr-columns", CONV, _CSR + "plan:CsrColumnsConfig", _P + "plan.conv:ConvPlan",
           _P + "plan.conv:make_conv_columns_plan", _P + "codegen.conv:render_conv", _CSR + "cost:csr_columns_estimate",
           _CSR + "space:conv_columns_candidates", _P + "plan.conv:execute_conv", None, residual=True,
           check=_P + "plan.conv:check_conv_columns", record_name="csr-columns"),
    Family("conv-tile", CONV, _P + "plan.config:TileConfig", _P + "plan.conv:ConvTilePlan",
           _P + "plan.conv:make_conv_tile_plan", _P + "codegen.ptx:render", _TILE + "cost:groups_estimate",
           _TILE + "space:conv_tile_candidates", _P + "plan.conv:execute_conv", None, residual=True,
           compile_seconds=_TILE + "cost:tile_config_compile_seconds", record_name="tile", weight_in_code=True),
)


def families(kind: str = SPMM) -> tuple[Family, ...]:
    """The families of one kind, in registration order."""
    return tuple(f for f in FAMILIES if f.kind == kind)


def family(name: str) -> Family:
    """The family registered under `name` (KeyError naming the known ones)."""
    for f in FAMILIES:
        if f.name == name:
            return f
    raise KeyError(f"no kernel family {name!r}; known: {', '.join(f.name for f in FAMILIES)}")


def config_classes(kind: str = SPMM) -> tuple[type, ...]:
    return tuple(f.config_class for f in families(kind))


def find_family(config, kind: str = SPMM) -> Family | None:
    """The family of `kind` whose config class `config` is exactly (a subclass is not its parent's
    family), or None."""
    for f in families(kind):
        if type(config) is f.config_class:
            return f
    return None


def family_of(config, kind: str = SPMM) -> Family:
    """The family of `kind` that takes `config`, or TypeError naming the config classes it could be."""
    found = find_family(config, kind)
    if found is None:
        names = ", ".join(c.__name__ for c in config_classes(kind))
        raise TypeError(f"config must be one of {names}, got {type(config).__name__}")
    return found


def family_recorded(name: str, kind: str = SPMM) -> Family | None:
    """The family of `kind` whose configs cached choices record under `name`, or None."""
    for f in families(kind):
        if f.choice_name == name:
            return f
    return None


def plan_family(plan) -> Family:
    """The family a plan belongs to: the one whose plan class and config class it has exactly."""
    for f in FAMILIES:
        if type(plan) is resolve(f.plan_class) and type(plan.config) is f.config_class:
            return f
    raise TypeError(f"{type(plan).__name__} with a {type(plan.config).__name__} is no registered family's plan")
