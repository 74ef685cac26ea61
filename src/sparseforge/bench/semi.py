"""2:4 on Sparse Tensor Cores against dense cuBLAS and torch's semi-structured path, one Linear shape and
input width at a time, on the GPU. Graph replay gives GPU time; eager timing adds each path's host cost,
which is where torch's semi-structured path spends its 450-800 us."""
from __future__ import annotations

import time

from ..codegen.gemv24 import MAX_N as GEMV_MAX_N  # widths the packed 2:4 GEMV serves
from ..suite.llm import BENCH24_GROUPS, LINEAR_SHAPES

# Linear layers (out_features, in_features) of BERT-base and Llama-class models, from the suite's one list.
SHAPES = {group: [LINEAR_SHAPES[name] for name in names] for group, names in BENCH24_GROUPS.items()}
WIDTHS = (1, 16, 64, 256, 2048, 8192)
# Relative error bounds against a float64 reference (fp32 accumulation, 16-bit output rounding).
TOLERANCE = {"float16": 5e-3, "bfloat16": 3e-2}


def random_24_weight(m: int, k: int, dtype, seed: int = 0):
    import torch

    from ..prune.nm import nm_mask

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(m, k, generator=g) / k ** 0.5
    return (w * nm_mask(w)).to("cuda", getattr(torch, dtype))


def run_case24(m: int, k: int, n: int, dtype: str, with_torch: bool = True, seed: int = 0) -> dict:
    import torch
    import torch.nn.functional as F

    from ..semi.runtime import Linear24Runtime, padded_input
    from ..semi.transpose import transpose_columns
    from ..runtime.timing import eager_time_us

    w = random_24_weight(m, k, dtype, seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    xs = [torch.randn(n, k, device="cuda", generator=g).to(w.dtype) for _ in range(3)]
    record = {"M": m, "K": k, "N": n, "dtype": dtype, "gpu": torch.cuda.get_device_name()}

    started = time.perf_counter()
    forced = Linear24Runtime(w, None, policy="sparse")
    choice, plan = forced.prepare(xs[0])
    decision = choice.graph
    record["setup_seconds"] = time.perf_counter() - started  # compression + cuSPARSELt search
    if plan is None:  # cuSPARSELt refused the shape: a result to report, not a crash
        return {**record, "sparse24_error": decision.reason, "error_ok": False}
    record.update(config_id=decision.config_id, padded_n=plan.padded_n, compressed_bytes=forced.compressed.nbytes)
    record.update(_check(plan, xs[0], w, dtype))

    measured = Linear24Runtime(w, None, policy="measure")
    chosen = measured.prepare(xs[0])[0]
    record["decision"], record["decision_eager"] = chosen.graph.path, chosen.eager.path
    out_t = torch.empty(m, plan.padded_n, dtype=w.dtype, device="cuda")
    padded = [padded_input(plan, x) for x in xs]
    paths = {"dense_us": lambda x: F.linear(x, w), "sparse24_us": forced, "with_fallback_us": measured,
             "matmul_only_us": lambda i: plan.run(padded[i], out_t),
             "transpose_us": lambda _: transpose_columns(out_t, n)}
    record.update(interleaved_us(paths, xs))
    record.update(interleaved_us({"dense_eager_us": lambda x: F.linear(x, w), "sparse24_eager_us": forced,
                                  "with_fallback_eager_us": measured}, xs, timer=eager_time_us))
    record["speedup_vs_dense"] = record["dense_us"] / record["sparse24_us"]
    record["fallback_speedup_vs_dense"] = record["dense_us"] / record["with_fallback_us"]
    if n <= GEMV_MAX_N:
        record.update(_packed_gemv(w, xs, dtype))
    if with_torch:
        record.update(_torch_semi_structured(w, xs, record))
    return record


def _packed_gemv(w, xs, dtype: str) -> dict:
    """sparseforge's CUDA-core 2:4 GEMV (decode widths): checked into a NaN-poisoned output, then timed."""
    import torch

    from ..semi.gemv import Gemv24
    from ..runtime.timing import eager_time_us, graph_time_us

    try:
        gemv = Gemv24(w)
        out = torch.full((xs[0].shape[0], w.shape[0]), float("nan"), dtype=w.dtype, device=w.device)
        gemv(xs[0], out=out)
        ref = xs[0].double() @ w.double().T
        err = float((out.double() - ref).norm() / ref.norm()) if torch.isfinite(out).all() else float("inf")
        result = {"gemv24_rel_error": err, "gemv24_error_ok": err <= TOLERANCE[dtype],
                  "gemv24_us": graph_time_us(gemv, xs), "gemv24_eager_us": eager_time_us(gemv, xs),
                  "gemv24_bytes": gemv.packed.nbytes}
    except Exception as exc:  # a failure of this experimental path is reported, not fatal to the run
        return {"gemv24_error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return result


def interleaved_us(paths: dict, xs: list, rounds: int = 3, timer=None) -> dict:
    """Medians of each path by `timer` (default graph replay), measured in alternating rounds so clock and
    cache drift between measurements lands on every path alike; the median over rounds is reported. A path
    named *_only_us or transpose_us gets the input's index, the others the input."""
    from statistics import median

    from ..runtime.timing import graph_time_us

    timer = timer or graph_time_us
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds):
        for name, fn in paths.items():
            by_index = name in ("matmul_only_us", "transpose_us")
            inputs = list(range(len(xs))) if by_index else xs
            samples[name].append(timer(fn, inputs, repeats=15))
    return {name: median(values) for name, values in samples.items()}


def _check(plan, x, w, dtype: str) -> dict:
    """Output of one plan run into a NaN-poisoned buffer, against float64."""
    import torch

    from ..semi.runtime import padded_input

    out = torch.full((w.shape[0], plan.padded_n), float("nan"), dtype=w.dtype, device=w.device)
    plan.run(padded_input(plan, x), out)
    got = out[:, : x.shape[0]].t().double()
    ref = x.double() @ w.double().T
    err = float((got - ref).norm() / ref.norm()) if torch.isfinite(got).all() else float("inf")
    return {"rel_error": err, "error_ok": err <= TOLERANCE[dtype]}


def _torch_semi_structured(w, xs, record: dict) -> dict:
    """torch.sparse.to_sparse_semi_structured (cuSPARSELt backend) through F.linear, as a user would call it."""
    import torch
    import torch.nn.functional as F

    from ..runtime.timing import TimingContention, eager_time_us, graph_time_us

    try:
        from torch.sparse import SparseSemiStructuredTensor, to_sparse_semi_structured

        SparseSemiStructuredTensor._FORCE_CUTLASS = False
        ws = to_sparse_semi_structured(w)
        out = {"torch_semi_eager_us": eager_time_us(lambda x: F.linear(x, ws), xs, repeats=10)}
    except Exception as exc:  # the baseline's own refusals are results too
        return {"torch_semi_error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    out["speedup_vs_torch_semi_eager"] = out["torch_semi_eager_us"] / record["sparse24_eager_us"]
    # what a SparseLinear24 user gets: 2:4 where it measured faster, dense elsewhere
    out["fallback_speedup_vs_torch_semi_eager"] = out["torch_semi_eager_us"] / record["with_fallback_eager_us"]
    try:
        out["torch_semi_us"] = graph_time_us(lambda x: F.linear(x, ws), xs, calls_per_graph=5, repeats=10)
    except TimingContention:
        raise
    except Exception as exc:
        out["torch_semi_graph_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    torch.cuda.synchronize()
    return out


def host_overhead_us(m: int = 768, k: int = 768, n: int = 16, dtype: str = "float16", calls: int = 300) -> dict:
    """Host microseconds per call (no synchronisation inside the loop) of each path on a small layer,
    where the GPU keeps up and the host is what is measured."""
    import torch
    import torch.nn.functional as F

    from ..nn import SparseLinear24

    w = random_24_weight(m, k, dtype)
    x = torch.randn(n, k, device="cuda").to(w.dtype)
    linear = torch.nn.Linear(k, m, bias=False, device="cuda", dtype=w.dtype)
    with torch.no_grad():
        linear.weight.copy_(w)
    module = SparseLinear24.from_dense(linear, policy="sparse")
    runtime = module.runtime()
    plan = runtime.prepare(x)[1]
    out_t = torch.empty(m, plan.padded_n, dtype=w.dtype, device="cuda")
    paths = {"sparseforge_module": module, "sparseforge_runtime": runtime, "dense_F_linear": lambda t: F.linear(t, w),
             "cusparselt_matmul_call": lambda t: plan.run(t, out_t), "torch_empty": lambda t: torch.empty_like(out_t),
             "output_transpose": lambda t: out_t.t().contiguous()}
    result = {"shape": [m, k, n], "dtype": dtype}
    try:
        from ..semi.gemv import Gemv24

        gemv, x1 = Gemv24(w), x[:1].clone()
        paths["packed_gemv_n1"] = lambda t: gemv(x1)        # decode: one row
        paths["dense_F_linear_n1"] = lambda t: F.linear(x1, w)
    except Exception as exc:  # the experimental path's failure is reported, not fatal
        result["packed_gemv_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    try:
        from torch.sparse import to_sparse_semi_structured

        ws = to_sparse_semi_structured(w)
        paths["torch_semi_structured"] = lambda t: F.linear(t, ws)
    except Exception:
        pass
    with torch.no_grad():
        for name, fn in paths.items():
            for _ in range(20):
                fn(x)
            torch.cuda.synchronize()
            count = calls if name != "torch_semi_structured" else 30
            samples = []
            for _ in range(count):
                t0 = time.perf_counter()
                fn(x)
                samples.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
            samples.sort()
            result[name] = samples[len(samples) // 2]
    return result
