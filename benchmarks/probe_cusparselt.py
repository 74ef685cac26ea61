"""Diagnose the cuSPARSELt path step by step, each variant in its own process (a faulting kernel poisons
the CUDA context): which library is loaded, whether torch's own cuSPARSELt path works, and which call of
ours fails. Writes JSON lines to stdout.

    CUDA_LAUNCH_BLOCKING=1 python benchmarks/probe_cusparselt.py
"""
import json
import os
import subprocess
import sys

VARIANTS = ["torch", "compress2", "compress_plan", "matmul_default", "matmul_sparse_ptr", "search", "search_sparse_ptr"]


def loaded_libs():
    with open("/proc/self/maps") as maps:
        return sorted({line.split()[-1] for line in maps if "cusparseLt" in line or "libcudart" in line})


def run(variant: str, m=64, k=64, n=16):
    if variant.startswith("config:"):  # "config:ID:M:K:N"
        _, cid, m, k, n = variant.split(":")
        return run_config(int(cid), int(m), int(k), int(n))
    import numpy as np
    import torch

    from sparseforge.prune import nm_mask

    w = torch.randn(m, k)
    w = (w * nm_mask(w)).half().cuda()
    x = torch.randn(n, k, device="cuda").half()
    ref = x.double() @ w.double().T
    if variant.startswith("ctypes"):  # ctypes:LAYOUT:search|plain:M:K:N
        _, layout, mode, m, k, n = variant.split(":")
        split_k = 1 if mode == "search1" else None
        return run_ctypes(layout, mode.startswith("search"), int(m), int(k), int(n), split_k=split_k,
                          sweep=mode == "sweep")
    if variant == "torch_search":
        wc = torch._cslt_compress(w)
        alg = torch._cslt_sparse_mm_search(wc, x.t())
        torch.cuda.synchronize()
        return {"alg_id": alg}
    if variant == "torch":
        wc = torch._cslt_compress(w)
        out = torch._cslt_sparse_mm(wc, x.t()).t()
        torch.cuda.synchronize()
        return {"err": float((out.double() - ref).norm() / ref.norm())}

    import nvmath
    from nvmath.bindings import cusparse
    from nvmath.bindings import cusparseLt as L

    h = L.init()
    vt = int(nvmath.CudaDataType.CUDA_R_16F)
    a = L.structured_descriptor_init(h, m, k, k, 16, vt, cusparse.Order.ROW, L.Sparsity.SPARSITY_50_PERCENT)
    b = L.dense_descriptor_init(h, k, n, k, 16, vt, cusparse.Order.COL)
    d = L.dense_descriptor_init(h, m, n, m, 16, vt, cusparse.Order.COL)
    op = cusparse.Operation.NON_TRANSPOSE
    mm = L.matmul_descriptor_init(h, op, op, a, b, d, d, L.ComputeType.COMPUTE_32F)
    if variant.endswith("sparse_ptr"):
        ptr = np.array([w.data_ptr()], dtype=np.int64)
        L.matmul_desc_set_attribute(h, mm, L.MatmulDescAttribute.SPARSE_MAT_POINTER, ptr.ctypes.data, 8)
    alg = L.matmul_alg_selection_init(h, mm, L.MatmulAlg.DEFAULT)
    plan = L.matmul_plan_init(h, mm, alg)
    stream = torch.cuda.current_stream().cuda_stream
    if variant == "compress_plan":
        size, scratch = L.sp_mma_compressed_size(h, plan)
        wc = torch.empty(size, dtype=torch.uint8, device="cuda")
        buf = torch.empty(max(scratch, 1), dtype=torch.uint8, device="cuda")
        L.sp_mma_compress(h, plan, w.data_ptr(), wc.data_ptr(), buf.data_ptr(), stream)
    else:
        size, scratch = L.sp_mma_compressed_size2(h, a)
        wc = torch.empty(size, dtype=torch.uint8, device="cuda")
        buf = torch.empty(max(scratch, 1), dtype=torch.uint8, device="cuda")
        L.sp_mma_compress2(h, a, 1, op, w.data_ptr(), wc.data_ptr(), buf.data_ptr(), stream)
    torch.cuda.synchronize()
    result = {"compressed_bytes": size, "scratch": scratch, "libs": loaded_libs()}
    if variant in ("compress2", "compress_plan"):
        return result
    ws_size = max(L.matmul_get_workspace(h, plan), 1 << 26 if variant == "search_bigws" else 1)
    ws = torch.empty(ws_size, dtype=torch.uint8, device="cuda")
    if variant == "search_nostream":
        stream = 0
    out = torch.full((n, m), float("nan"), device="cuda").half()
    alpha, beta = np.ones(1, np.float32), np.zeros(1, np.float32)
    streams = np.array([stream], dtype=np.intp)
    fn = L.matmul_search if variant.startswith("search") else L.matmul
    if variant == "search_nostream":
        fn(h, plan, alpha.ctypes.data, wc.data_ptr(), x.data_ptr(), beta.ctypes.data, out.data_ptr(),
           out.data_ptr(), ws.data_ptr(), 0, 0)
        torch.cuda.synchronize()
        result["err"] = float((out.double() - ref).norm() / ref.norm())
        return result
    fn(h, plan, alpha.ctypes.data, wc.data_ptr(), x.data_ptr(), beta.ctypes.data, out.data_ptr(), out.data_ptr(),
       ws.data_ptr(), streams.ctypes.data, 1)
    torch.cuda.synchronize()
    result["err"] = float((out.double() - ref).norm() / ref.norm())
    return result


def run_ctypes(layout: str, search: bool, m=64, k=64, n=16, opaque=16384, split_k=None, sweep=False):
    """The calls through ctypes, one operand layout at a time:
    colD: A=W row, B=X^T col, D=Y^T col (Y in place); rowD: as torch, D row-major M x N (needs a transpose);
    sparseB: A=X row (N x K), B=W^T structured col (K x M), D=Y row (N x M)."""
    import ctypes

    import torch

    from sparseforge.prune import nm_mask

    path = next(p for p in loaded_libs_after_torch() if "cusparseLt" in p)
    lib = ctypes.CDLL(path)
    new = lambda: ctypes.create_string_buffer(opaque)  # noqa: E731
    h, a, b, d, mm, alg, plan = (new() for _ in range(7))

    def ok(status, what):
        if status:
            raise RuntimeError(f"{what}: status {status}")

    w = torch.randn(m, k)
    w = (w * nm_mask(w)).half().cuda()
    x = torch.randn(n, k, device="cuda").half()
    ref = x.double() @ w.double().T
    i64, u32, c_int = ctypes.c_int64, ctypes.c_uint32, ctypes.c_int
    ROW, COL, F16 = c_int(2), c_int(1), c_int(2)
    ok(lib.cusparseLtInit(h), "init")
    sparse = a
    if layout == "sparseB":
        sparse = b
        ok(lib.cusparseLtDenseDescriptorInit(h, a, i64(n), i64(k), i64(k), u32(16), F16, ROW), "A")
        ok(lib.cusparseLtStructuredDescriptorInit(h, b, i64(k), i64(m), i64(k), u32(16), F16, COL, c_int(0)), "B")
        ok(lib.cusparseLtDenseDescriptorInit(h, d, i64(n), i64(m), i64(m), u32(16), F16, ROW), "D")
    else:
        ok(lib.cusparseLtStructuredDescriptorInit(h, a, i64(m), i64(k), i64(k), u32(16), F16, ROW, c_int(0)), "A")
        ok(lib.cusparseLtDenseDescriptorInit(h, b, i64(k), i64(n), i64(k), u32(16), F16, COL), "B")
        if layout == "rowD":
            ok(lib.cusparseLtDenseDescriptorInit(h, d, i64(m), i64(n), i64(n), u32(16), F16, ROW), "D")
        else:
            ok(lib.cusparseLtDenseDescriptorInit(h, d, i64(m), i64(n), i64(m), u32(16), F16, COL), "D")
    ok(lib.cusparseLtMatmulDescriptorInit(h, mm, c_int(0), c_int(0), a, b, d, d, c_int(2)), "matmul")
    ok(lib.cusparseLtMatmulAlgSelectionInit(h, alg, mm, c_int(0)), "alg")
    if split_k is not None:
        value = ctypes.c_int(split_k)
        ok(lib.cusparseLtMatmulAlgSetAttribute(h, alg, c_int(3), ctypes.byref(value), ctypes.c_size_t(4)), "split_k")
    ok(lib.cusparseLtMatmulPlanInit(h, plan, mm, alg), "plan")
    size, scratch, wsz = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_size_t()
    ok(lib.cusparseLtSpMMACompressedSize2(h, sparse, ctypes.byref(size), ctypes.byref(scratch)), "size")
    wc = torch.empty(size.value, dtype=torch.uint8, device="cuda")
    buf = torch.empty(max(scratch.value, 1), dtype=torch.uint8, device="cuda")
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    ok(lib.cusparseLtSpMMACompress2(h, sparse, c_int(int(layout != "sparseB")), c_int(0), ctypes.c_void_p(w.data_ptr()),
                                    ctypes.c_void_p(wc.data_ptr()), ctypes.c_void_p(buf.data_ptr()), stream), "compress")
    ok(lib.cusparseLtMatmulGetWorkspace(h, plan, ctypes.byref(wsz)), "workspace")
    ws = torch.empty(max(wsz.value, 1 << 24), dtype=torch.uint8, device="cuda")
    out = torch.full((n, m), float("nan"), device="cuda").half()
    alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
    streams = (ctypes.c_void_p * 1)(stream.value)
    pa, pb = (wc, x) if layout != "sparseB" else (x, wc)

    def call(fn):
        return fn(h, plan, ctypes.byref(alpha), ctypes.c_void_p(pa.data_ptr()), ctypes.c_void_p(pb.data_ptr()),
                  ctypes.byref(beta), ctypes.c_void_p(out.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                  ctypes.c_void_p(ws.data_ptr()), streams, c_int(1))

    if sweep:  # every config id: status, error, time
        top = ctypes.c_int(-1)
        ok(lib.cusparseLtMatmulAlgGetAttribute(h, alg, c_int(1), ctypes.byref(top), ctypes.c_size_t(4)), "max id")
        rows = []
        for cid in range(top.value):
            value = ctypes.c_int(cid)
            status = lib.cusparseLtMatmulAlgSetAttribute(h, alg, c_int(0), ctypes.byref(value), ctypes.c_size_t(4))
            p2 = new()
            status = status or lib.cusparseLtMatmulPlanInit(h, p2, mm, alg)
            wsz2 = ctypes.c_size_t()
            status = status or lib.cusparseLtMatmulGetWorkspace(h, p2, ctypes.byref(wsz2))
            if status or wsz2.value > ws.numel():
                rows.append((cid, f"status {status} ws {wsz2.value}"))
                continue
            out.fill_(float("nan"))
            run = lambda p2=p2: lib.cusparseLtMatmul(h, p2, ctypes.byref(alpha), ctypes.c_void_p(pa.data_ptr()),  # noqa: E731
                                               ctypes.c_void_p(pb.data_ptr()), ctypes.byref(beta),
                                               ctypes.c_void_p(out.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                                               ctypes.c_void_p(ws.data_ptr()), streams, c_int(1))
            status = run()
            torch.cuda.synchronize()
            if status:
                rows.append((cid, f"run status {status}"))
                continue
            got = out.view(m, n).t() if layout == "rowD" else out
            e = float((got.double() - ref).norm() / ref.norm())
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            for _ in range(10):
                run()
            t1.record()
            torch.cuda.synchronize()
            rows.append((cid, round(e, 6), round(t0.elapsed_time(t1) * 100, 1)))
        return {"max_id": top.value, "sweep": rows}
    if search:
        ok(call(lib.cusparseLtMatmulSearch), "search")
    ok(call(lib.cusparseLtMatmul), "matmul")
    torch.cuda.synchronize()
    got = out.view(m, n).t() if layout == "rowD" else out
    cid = ctypes.c_int(-1)
    ok(lib.cusparseLtMatmulAlgGetAttribute(h, alg, c_int(0), ctypes.byref(cid), ctypes.c_size_t(4)), "get id")
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        call(lib.cusparseLtMatmul)
    stop.record()
    torch.cuda.synchronize()
    dense = torch.nn.functional.linear
    for _ in range(5):
        dense(x, w)
    start3, stop3 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start3.record()
    for _ in range(20):
        out.view(m, n).t().contiguous()
    stop3.record()
    start2, stop2 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start2.record()
    for _ in range(20):
        dense(x, w)
    stop2.record()
    torch.cuda.synchronize()
    return {"err": float((got.double() - ref).norm() / ref.norm()), "config_id": cid.value,
            "us": start.elapsed_time(stop) * 50, "dense_us": start2.elapsed_time(stop2) * 50,
            "transpose_us": start3.elapsed_time(stop3) * 50}


def loaded_libs_after_torch():
    import torch

    torch.empty(1, device="cuda")
    found = loaded_libs()
    if not any("cusparseLt" in p for p in found):
        import glob
        import os as _os

        found += glob.glob(_os.path.join(_os.path.dirname(torch.__file__), "..", "nvidia", "cusparselt", "lib",
                                         "libcusparseLt.so*"))
    return found


def run_config(cid: int, m: int, k: int, n: int):
    """One algorithm config id, timed: does it run, is it right, how fast."""
    import numpy as np
    import torch

    from sparseforge.prune import nm_mask
    from sparseforge.semi.cusparselt import CompressedWeight, MatmulPlan
    from nvmath.bindings import cusparseLt as L

    w = torch.randn(m, k)
    w = (w * nm_mask(w)).half().cuda()
    x = torch.randn(n, k, device="cuda").half()
    plan = MatmulPlan(CompressedWeight(w), n)
    h = plan.weight.library.handle
    top = np.zeros(1, np.int32)
    L.matmul_alg_get_attribute(h, plan.alg, L.MatmulAlgAttribute.CONFIG_MAX_ID, top.ctypes.data, 4)
    value = np.array([cid], np.int32)
    L.matmul_alg_set_attribute(h, plan.alg, L.MatmulAlgAttribute.CONFIG_ID, value.ctypes.data, 4)
    plan._plan_finalizer()
    plan.plan = L.matmul_plan_init(h, plan.matmul_desc, plan.alg)
    plan.workspace = plan._workspace()
    out = torch.full((n, m), float("nan"), device="cuda").half()
    plan.run(x, out)
    torch.cuda.synchronize()
    ref = x.double() @ w.double().T
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        plan.run(x, out)
    stop.record()
    torch.cuda.synchronize()
    return {"config_max_id": int(top[0]), "err": float((out.double() - ref).norm() / ref.norm()),
            "us": start.elapsed_time(stop) * 50}


def main():
    if len(sys.argv) > 1:
        try:
            print(json.dumps({"variant": sys.argv[1], "ok": True, **run(sys.argv[1])}), flush=True)
        except Exception as exc:
            print(json.dumps({"variant": sys.argv[1], "ok": False, "error": f"{type(exc).__name__}: {exc}"[:400]}),
                  flush=True)
        return
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1"}
    combos = [f"ctypes:{lay}:sweep:{shape}" for shape in ("4096:4096:2048", "768:768:16", "14336:4096:8192")
              for lay in ("colD", "sparseB", "rowD")]
    for variant in combos:
        done = subprocess.run([sys.executable, __file__, variant], capture_output=True, text=True, env=env, timeout=120)
        print(done.stdout.strip(), json.dumps({"variant": variant, "rc": done.returncode, "stderr": done.stderr[-300:]}),
              flush=True)


if __name__ == "__main__":
    main()
