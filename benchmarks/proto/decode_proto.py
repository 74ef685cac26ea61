"""Design prototype (16-bit decode on tensor cores): time the tensor-core scatter decode kernel (mma_scatter.cu) in its variants
against cuBLAS on Llama-shaped layers, both protocols (L2-resident, weights rotated through HBM), and a plain
read of the same bytes (the floor). One device call decides which variant the generator builds.

    python benchmarks/proto/decode_proto.py CUBIN OUT.json [--shapes 4096x4096,...] [--sparsities 0.5,0.7,0.9]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from sparseforge.runtime.driver import LoadedKernel  # noqa: E402
from sparseforge.runtime.timing import graph_time_us, l2_bytes, rotating_graph_time_us, weight_copies  # noqa: E402
from sparseforge.suite.llm import magnitude_prune, seeded_weight  # noqa: E402


def swizzled(r, c):
    return r * 16 + (((c >> 3) ^ ((r >> 2) & 1)) << 3) + (c & 7)


def build_format(w):
    """(header uint32 [S*T], pos uint8 [slots], vals float16 [slots], S, T)."""
    m, k = w.shape
    S, T = -(-m // 16), -(-k // 16)
    rows = np.repeat(np.arange(m, dtype=np.int64), np.diff(w.indptr))
    cols = w.indices.astype(np.int64)
    tile = (rows // 16) * T + cols // 16
    key = tile * 256 + swizzled(rows % 16, cols % 16)
    order = np.argsort(key, kind="stable")
    key = key[order]
    tile_sorted = key >> 8
    pos_sorted = (key & 255).astype(np.uint8)
    vals_sorted = w.values.astype(np.float16)[order]
    counts = np.bincount(tile_sorted, minlength=S * T).astype(np.int64)
    cpad = -(-counts // 4) * 4
    starts = np.concatenate([[0], np.cumsum(cpad)[:-1]])
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    total = int(cpad.sum())
    assert total // 4 < 2 ** 25
    tile_of = np.repeat(np.arange(S * T, dtype=np.int64), cpad)
    e = np.arange(total, dtype=np.int64) - starts[tile_of]
    src = first[tile_of] + np.minimum(e, counts[tile_of] - 1)
    lanes = cpad[tile_of] // 4
    rnd, e2 = e // 128, e % 128
    lr = np.minimum(32, lanes - 32 * rnd)
    slot = starts[tile_of] + 128 * rnd + 4 * (e2 % lr) + e2 // lr
    pos = np.zeros(max(total, 4), np.uint8)
    vals = np.zeros(max(total, 4), np.float16)
    pos[slot] = pos_sorted[src]
    vals[slot] = vals_sorted[src]
    header = ((starts // 4) << 7 | (cpad // 4)).astype(np.uint32)
    return header, pos, vals, S, T


VARIANTS = {1: [(1, 4, 2, 0), (1, 4, 4, 0), (1, 8, 2, 0), (1, 8, 4, 0), (1, 16, 2, 0), (1, 4, 4, 1), (1, 8, 4, 1), (1, 8, 2, 1)],
            8: [(1, 4, 4, 0), (1, 8, 2, 0), (1, 8, 4, 0), (1, 8, 4, 1)],
            16: [(2, 4, 4, 0), (2, 8, 2, 0), (2, 8, 4, 0), (2, 8, 4, 1), (2, 4, 4, 1)]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cubin")
    ap.add_argument("out")
    ap.add_argument("--shapes", default="4096x4096,14336x4096,4096x14336,1024x4096")
    ap.add_argument("--sparsities", default="0.5,0.7,0.9")
    ap.add_argument("--n", default="1,8,16")
    args = ap.parse_args()
    cubin = Path(args.cubin).read_bytes()
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    kernels = {}
    l2 = l2_bytes()
    results = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
               "l2_bytes": l2, "cases": []}
    sink = torch.zeros(4, dtype=torch.int32, device=dev)
    stream_k = LoadedKernel(cubin, "stream_read", 0)
    for shape in args.shapes.split(","):
        m, k = map(int, shape.split("x"))
        dense32 = seeded_weight(m, k, 0)
        for sp in map(float, args.sparsities.split(",")):
            t0 = time.perf_counter()
            w = magnitude_prune(dense32, sp)
            header, pos, vals, S, T = build_format(w)
            build_s = time.perf_counter() - t0
            wd = torch.from_numpy(w.to_dense().astype(np.float16)).to(dev)
            arrays = [torch.from_numpy(header.view(np.int32)).to(dev), torch.from_numpy(pos).to(dev),
                      torch.from_numpy(vals.view(np.int16)).to(dev)]
            fmt_bytes = sum(a.numel() * a.element_size() for a in arrays)
            for n in map(int, args.n.split(",")):
                gen = torch.Generator(device=dev).manual_seed(n)
                xin = [torch.randn(n, k, device=dev, generator=gen).half() for _ in range(3)]
                out = torch.empty(n, m, device=dev, dtype=torch.float16)
                outf = torch.empty(n, m, device=dev, dtype=torch.float32)
                in_bytes = n * k * 2
                dense_copies = weight_copies(m * k * 2 + in_bytes, l2)
                weights = [wd] + [wd.clone() for _ in range(dense_copies - 1)]
                dx = [torch.randn(n, k, device=dev, generator=gen).half() for _ in range(dense_copies)]
                cublas_res = graph_time_us(lambda x: torch.mm(x, wd.t(), out=out), xin)
                cublas_rot = rotating_graph_time_us(lambda p: torch.mm(p[1], p[0].t(), out=out), list(zip(weights, dx)))
                del weights
                copies = weight_copies(fmt_bytes + in_bytes, l2)
                sets = [arrays] + [[a.clone() for a in arrays] for _ in range(copies - 1)]
                sx = [torch.randn(n, k, device=dev, generator=gen).half() for _ in range(copies)]
                words = fmt_bytes // 16
                flat = [torch.cat([a.view(torch.uint8).reshape(-1) for a in s_])[: words * 16] for s_ in sets]
                floor_rot = rotating_graph_time_us(
                    lambda f: stream_k.launch_args((264, 1, 1), 512, torch.cuda.current_stream().cuda_stream,
                                                   (f.data_ptr(), words, sink.data_ptr()), (ctypes_p, ctypes_sz, ctypes_p)),
                    flat)
                del flat
                ref = (w.to_dense().astype(np.float16).astype(np.float64) @ xin[0].double().cpu().numpy().T).T
                case = {"shape": shape, "M": m, "K": k, "sparsity": sp, "N": n, "nnz": int(w.nnz), "format_bytes": fmt_bytes,
                        "dense_bytes": m * k * 2, "build_s": round(build_s, 2), "cublas_us": cublas_res,
                        "cublas_rotating_us": cublas_rot, "floor_rotating_us": floor_rot, "variants": []}
                for nt, wp, d, atomic in VARIANTS.get(n, VARIANTS[16] if n > 8 else VARIANTS[8]):
                    if 8 * nt < n:
                        continue
                    name = f"mma_scatter_n{nt}_w{wp}_d{d}_a{atomic}"
                    if name not in kernels:
                        kernels[name] = LoadedKernel(cubin, name, 0)
                    kern = kernels[name]
                    for ksplit in ((1,) if not atomic else (2, 4)):
                        tb = -(-T // ksplit)

                        def run(p, kern=kern, tb=tb, ksplit=ksplit, atomic=atomic):
                            arr, x = p
                            target = outf if atomic else out
                            if atomic:
                                target.zero_()
                            kern.launch_args((S, ksplit, 1), wp * 32, torch.cuda.current_stream().cuda_stream,
                                             (arr[0].data_ptr(), arr[1].data_ptr(), arr[2].data_ptr(), x.data_ptr(),
                                              target.data_ptr(), m, k, n, T, tb),
                                             (ctypes_p,) * 5 + (ctypes_i,) * 5)
                        target = outf if atomic else out
                        target.fill_(float("nan"))
                        run((arrays, xin[0]))
                        torch.cuda.synchronize()
                        got = target.double().cpu().numpy()
                        err = float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)) if np.isfinite(got).all() else float("nan")
                        res = graph_time_us(run, [(arrays, x) for x in xin])
                        rot = rotating_graph_time_us(run, list(zip(sets, sx)))
                        case["variants"].append({"kernel": name, "ksplit": ksplit, "rel_err": err, "us": res,
                                                 "rotating_us": rot, "regs": kern.registers})
                del sets
                best = min(case["variants"], key=lambda v: v["rotating_us"] if v["rel_err"] < 5e-3 else 1e9)
                case["best"] = best
                results["cases"].append(case)
                print(f"{shape:>11} {sp:.2f} N={n:<3} cuBLAS {cublas_res:6.2f}/{cublas_rot:6.2f} us  floor {floor_rot:6.2f}"
                      f"  best {best['kernel']} k{best['ksplit']} {best['us']:6.2f}/{best['rotating_us']:6.2f} us "
                      f"err {best['rel_err']:.1e}  x{cublas_rot / best['rotating_us']:.2f} rot, x{cublas_res / best['us']:.2f} res "
                      f"({m * k * 2 / fmt_bytes:.2f}x fewer bytes)", flush=True)
                Path(args.out).write_text(json.dumps(results, indent=1))


import ctypes  # noqa: E402

ctypes_p, ctypes_i, ctypes_sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t

if __name__ == "__main__":
    main()
