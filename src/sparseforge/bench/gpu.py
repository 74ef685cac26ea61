"""One benchmark case on the GPU: sparseforge vs cuBLAS (dense, TF32 off and on) vs cuSPARSE (torch CSR),
all timed by graph replay in this process, every output checked against a float64 reference."""
from __future__ import annotations

import math

from ..suite import Case
from ..runtime.timing import TimingContention, eager_time_us, graph_time_us

TOLERANCE = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 3e-2}
H200 = {"bandwidth": 4.3e12, "fp32_fma": 67e12}  # measured copy bandwidth; datasheet FP32 (CUDA cores)


def relative_error(out, ref) -> float:
    import torch

    out = out.double()
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def _inputs(shape, dtype, count: int, seed: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(shape, device="cuda", generator=g).to(dtype) for _ in range(count)]


def spmm_kernel_args(case: Case, dtype_name: str, layout: str, n: int, tune_budget: float | None,
                     seed: int = 0) -> dict:
    """What run_case's compile_spmm and prebuild_case's prebuild_spmm take, alike (their cache keys match only if
    every argument does)."""
    return {"W": case.load(seed=seed, dtype=dtype_name), "n": n, "dtype": dtype_name, "layout": layout,
            "tune_budget": tune_budget}


def prebuild_case(case: Case, dtype_name: str, layout: str, n: int, tune_budget: float | None, arch: int,
                  seed: int = 0) -> int:
    """Compile into the disk cache, without a GPU, the kernels run_case with the same arguments (and no config)
    will compile on an sm_`arch` GPU (spmm.prebuild_spmm); how many."""
    from ..spmm import prebuild_spmm

    return prebuild_spmm(**spmm_kernel_args(case, dtype_name, layout, n, tune_budget, seed), arch=arch)


def run_case(case: Case, dtype_name: str, layout: str, n: int, tune_budget: float | None, seed: int = 0,
             config=None, with_cusparse: bool = True, rotate_weights: bool = False) -> dict:
    """config: a fixed TileConfig (no tuning); else chosen with tune_budget seconds of timing (None: the
    cost model's pick, nothing timed).
    with_cusparse=False skips the cuSPARSE baseline (design comparisons need only cuBLAS).
    rotate_weights: also time both sides with W rotated through copies that together exceed the L2 twice
    (`*_rotating_*` keys), as a many-layer decoder streams its weights from HBM; the plain keys keep W
    resident in L2 (one copy)."""
    from ..spmm import compile_spmm

    arguments = spmm_kernel_args(case, dtype_name, layout, n, tune_budget, seed)
    kernel = compile_spmm(**arguments, config=config)
    return _check_and_time(case, kernel, arguments["W"], dtype_name, layout, n, tune_budget, seed, with_cusparse,
                           rotate_weights)


def _check_and_time(case: Case, kernel, w, dtype_name: str, layout: str, n: int, tune_budget: float | None,
                    seed: int, with_cusparse: bool, rotate_weights: bool) -> dict:
    """The record of a compiled case: its output checked against float64, its time beside cuBLAS's and
    cuSPARSE's."""
    import torch

    dtype = getattr(torch, dtype_name)
    shape = (case.K, n) if layout == "kn" else (n, case.K)
    inputs = _inputs(shape, dtype, 4, seed + 1)
    dense = w.to_torch("cuda")
    ref_w = dense.double()
    # correctness: NaN-poisoned output, float64 reference on the same (rounded) operands
    out = torch.full(kernel.out_shape, float("nan"), device="cuda", dtype=dtype)
    kernel(inputs[0], out=out)
    ref = ref_w @ inputs[0].double() if layout == "kn" else inputs[0].double() @ ref_w.T
    error = relative_error(out, ref)

    record = {"case": case.name, "model": case.model, "sparsity": case.sparsity, "M": case.M, "K": case.K,
              "N": n, "nnz": case.nnz, "dtype": dtype_name, "layout": layout, "rel_error": error,
              "error_ok": error <= TOLERANCE[dtype_name], "config": kernel.plan.config.short(),
              "mapping": kernel.mapping, "compile_seconds": kernel.compile_seconds,
              "tune_seconds": kernel.tune_seconds, "tune_budget": tune_budget, "cache_hit": kernel.cache_hit,
              "registers": kernel.registers}
    if kernel.choice is not None:  # every candidate the chooser predicted and timed (bench --explain)
        record["choice"] = kernel.choice.as_dict()
        record["dense_faster"] = kernel.dense_faster
    out_buf = torch.empty(kernel.out_shape, device="cuda", dtype=dtype)
    record["sparseforge_us"] = graph_time_us(lambda b: kernel(b, out=out_buf), inputs)
    record.update(_dense_times(dense, inputs, layout, dtype))
    if with_cusparse:
        record.update(_cusparse_time(dense, inputs, layout))
    _add_ratios_and_roofline(record, case, n, dtype_name)
    _add_traffic(record, kernel.plan)
    if rotate_weights:
        record.update(_rotating_times(kernel, dense, layout, dtype, shape, seed))
    return record


def _rotating_times(kernel, dense, layout: str, dtype, shape, seed: int) -> dict:
    """Both sides timed with W rotated through copies (runtime.timing.weight_copies), each call on its
    own copy and input, with the bytes each side streams per call and the rate that makes (TB/s)."""
    import torch

    from ..runtime.kernel import kernel_copies, release_copies
    from ..runtime.timing import l2_bytes, rotating_graph_time_us, weight_copies

    l2 = l2_bytes()
    in_bytes = math.prod(shape) * dense.element_size()
    out_bytes = math.prod(kernel.out_shape) * dense.element_size()
    sparse_bytes = kernel.weight_bytes
    # where W is the code, each copy is a load of the cubin
    sparse_copies = weight_copies(sparse_bytes + getattr(kernel, "code_bytes", 0) + in_bytes, l2)
    copies = kernel_copies(kernel, sparse_copies - 1)
    inputs = _inputs(shape, dtype, sparse_copies, seed + 7)
    out = torch.empty(kernel.out_shape, device="cuda", dtype=dtype)
    try:
        sparse_us = rotating_graph_time_us(lambda p: p[0](p[1], out=out), list(zip([kernel] + copies, inputs)))
    finally:
        torch.cuda.synchronize()
        release_copies(copies)
    del copies
    dense_bytes = dense.numel() * dense.element_size()
    dense_copies = weight_copies(dense_bytes + in_bytes, l2)
    weights = [dense] + [dense.clone() for _ in range(dense_copies - 1)]
    inputs = _inputs(shape, dtype, dense_copies, seed + 8)
    if layout == "kn":
        fn = lambda p: torch.mm(p[0], p[1], out=out)  # noqa: E731
    else:
        fn = lambda p: torch.mm(p[1], p[0].t(), out=out)  # noqa: E731
    previous = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        dense_us = rotating_graph_time_us(fn, list(zip(weights, inputs)))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    del weights
    # a code kernel's W is its instruction stream (not counted: weight_bytes 0)
    moved_sparse, moved_dense = sparse_bytes + in_bytes + out_bytes, dense_bytes + in_bytes + out_bytes
    return {"sparseforge_rotating_us": sparse_us, "cublas_rotating_us": dense_us,
            "speedup_vs_cublas_rotating": dense_us / sparse_us, "weight_copies": sparse_copies,
            "dense_weight_copies": dense_copies, "l2_bytes": l2, "sparse_weight_bytes": sparse_bytes,
            "sparse_code_bytes": getattr(kernel, "code_bytes", 0),
            # the format as built (offsets and padding included) against dense's 2 or 4 bytes a weight
            "sparse_bytes_per_weight": sparse_bytes / max(dense.numel(), 1),
            "sparseforge_rotating_tbs": moved_sparse / (sparse_us * 1e-6) / 1e12,
            "cublas_rotating_tbs": moved_dense / (dense_us * 1e-6) / 1e12}


def _add_traffic(record: dict, plan) -> None:
    """The bytes the plan makes the kernel fetch (plan.operand_bytes: B re-read per row group, the usual
    limit) and the rate that implies: the 'why' behind a case far from its byte floor."""
    from .report import plan_traffic

    fetched = plan_traffic(plan)["fetched_bytes"]
    record["fetched_bytes"] = fetched
    record["fetched_tbs"] = fetched / (record["sparseforge_us"] * 1e-6) / 1e12


def _dense_times(dense, inputs, layout: str, dtype) -> dict:
    import torch

    result = {}
    out = torch.empty((dense.shape[0], inputs[0].shape[1]) if layout == "kn" else (inputs[0].shape[0], dense.shape[0]),
                      device="cuda", dtype=dtype)
    wt = dense.t()
    fn = (lambda b: torch.mm(dense, b, out=out)) if layout == "kn" else (lambda x: torch.mm(x, wt, out=out))
    previous = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        result["cublas_us"] = graph_time_us(fn, inputs)
        if dtype == torch.float32:
            torch.backends.cuda.matmul.allow_tf32 = True
            result["cublas_tf32_us"] = graph_time_us(fn, inputs)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    return result


def _cusparse_time(dense, inputs, layout: str) -> dict:
    import torch

    try:
        csr = dense.to_sparse_csr()
        fn = (lambda b: torch.mm(csr, b)) if layout == "kn" else (lambda x: torch.mm(csr, x.t()).t())
        try:
            return {"cusparse_us": graph_time_us(fn, inputs), "cusparse_timing": "graph"}
        except TimingContention:
            raise
        except Exception:
            torch.cuda.synchronize()
            return {"cusparse_us": eager_time_us(fn, inputs), "cusparse_timing": "eager (graph capture refused)"}
    except TimingContention:
        raise
    except Exception as err:
        return {"cusparse_us": None, "cusparse_error": f"{type(err).__name__}: {str(err)[:200]}"}


def _add_ratios_and_roofline(record: dict, case: Case, n: int, dtype_name: str) -> None:
    t = record["sparseforge_us"]
    record["speedup_vs_cublas"] = record["cublas_us"] / t
    if record.get("cublas_tf32_us"):
        record["speedup_vs_cublas_tf32"] = record["cublas_tf32_us"] / t
    if record.get("cusparse_us"):
        record["speedup_vs_cusparse"] = record["cusparse_us"] / t
    es = 4 if dtype_name == "float32" else 2
    bytes_min = (case.K * n + case.M * n) * es
    flops = 2 * case.nnz * n
    record["bytes_min"], record["flops"] = bytes_min, flops
    record["floor_us"] = max(bytes_min / H200["bandwidth"], flops / H200["fp32_fma"]) * 1e6
    record["achieved_gbs"] = bytes_min / (t * 1e-6) / 1e9
    record["achieved_tflops"] = flops / (t * 1e-6) / 1e12
