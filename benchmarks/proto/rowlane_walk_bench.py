"""The one-row-a-lane bitmap decode (rowlane_walk.cu) against cuBLAS at N = 1: weights rotated through HBM,
outputs NaN-poisoned and checked against float64, a sweep of K-slice width / warps a block / quads in
flight per case. `--check` runs a CPU emulation of the kernel (its lockstep, sentinels and layout) against
the dense product (no GPU needed).

Knobs (environment): SHAPES ("4096x4096 ..."), SPS ("0.5 0.7 0.9"), SLICES ("128 256 512 1024"), WARPS
("4 8"), PFS ("4 8"), BF16=1, e.g.
    SHAPES=4096x4096 SPS=0.5 python3 benchmarks/proto/rowlane_walk_bench.py /tmp/rowlane.json"""
import json, math, os, sys, time
import torch

from proto_timing import compiled, graph_us, pruned_case, summary_rows
from sparseforge.bench.report import provenance

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = open(os.path.join(HERE, "rowlane_walk.cu")).read()


def pack(w: torch.Tensor, slice_cols: int) -> dict:
    """rowlane_walk.cu's format, built by torch ops on w's device (see the kernel's header)."""
    assert slice_cols % 32 == 0
    m, k = w.shape
    dev = w.device
    G, nwk, S = -(-m // 32), -(-k // 32), -(-k // slice_cols)
    wp = torch.zeros(G * 32, S * slice_cols, dtype=w.dtype, device=dev)
    wp[:m, :k] = w
    mask = wp != 0
    shifts = 31 - torch.arange(32, device=dev, dtype=torch.int64)
    words = (mask[:, :nwk * 32].reshape(G * 32, nwk, 32).to(torch.int64) << shifts).sum(-1)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    bm = words.view(G, 32, nwk).permute(0, 2, 1).contiguous()              # [G][K/32][32]
    runs = mask.view(G * 32, S, slice_cols).sum(-1)                         # nonzeros a (row, slice)
    run_quads = (runs + 3) // 4
    starts = torch.cumsum(run_quads, 1) - run_quads                          # a slice's first quad in its row
    if int(run_quads.sum(1).max()) >= 2 ** 16:
        raise ValueError("a row's quads overflow the 16-bit slice offsets")
    group_quads = run_quads.sum(1).view(G, 32).max(1).values
    gbase = torch.cumsum(group_quads, 0) - group_quads
    rows_total = max(int(group_quads.sum()), 1)  # a lane loads its own run's quads only
    vals = torch.zeros(rows_total * 32 * 4, dtype=w.dtype, device=dev)
    rows, cols = mask.nonzero(as_tuple=True)                                 # row-major, columns ascending
    piece = cols // slice_cols
    flat = runs.reshape(-1)
    first = torch.cumsum(flat, 0) - flat
    rank = torch.arange(rows.numel(), device=dev) - first[rows * S + piece]
    quad = gbase[rows // 32] + starts[rows, piece] + rank // 4
    vals[(quad * 32 + rows % 32) * 4 + rank % 4] = wp[rows, cols]
    off = starts.view(G, 32, S).permute(0, 2, 1).contiguous()
    off = torch.where(off >= 2 ** 15, off - 2 ** 16, off).to(torch.int16)    # uint16 bits
    return dict(bm=bm, vals=vals, gbase=gbase.to(torch.int64).contiguous(), off=off, m=m, k=k, S=S,
                slice=slice_cols, G=G, used_quads=int(run_quads.sum()))


def nbytes(p) -> int:
    return sum(p[q].numel() * p[q].element_size() for q in ("bm", "vals", "gbase", "off"))


def read_bytes(p) -> int:
    """What a call reads: the bitmap, the runs' quads (not the ELL padding), the offsets."""
    return p["bm"].numel() * 4 + p["used_quads"] * 8 + p["gbase"].numel() * 8 + p["off"].numel() * 2


def emulate(p, x: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic lane by lane (float64), lockstep, sentinel words and zeros of x included."""
    m, k, S, sl, G = p["m"], p["k"], p["S"], p["slice"], p["G"]
    bm = p["bm"].cpu().to(torch.int64) & 0xffffffff
    vals = p["vals"].cpu().double().view(-1, 32, 4)
    gbase, off = p["gbase"].cpu().tolist(), (p["off"].cpu().to(torch.int64) & 0xffff)
    nw, nwk = sl // 32, -(-k // 32)
    y = torch.zeros(G * 32, dtype=torch.float64)
    x = x.double().cpu()
    for s in range(S):
        c0 = s * sl
        xs = torch.zeros(2 * sl, dtype=torch.float64)
        for i in range(sl):
            c = c0 + (i & ~31) + (31 - (i & 31))
            if c < k:
                xs[i] = x[c]
        for g in range(G):
            words = [[int(bm[g, c0 // 32 + w, lane]) if c0 // 32 + w < nwk else 0 for w in range(nw)]
                     + [0xffffffff] * nw for lane in range(32)]
            counts = [sum(bin(v).count("1") for v in ws[:nw]) for ws in words]
            quads = (max(counts) + 3) // 4
            for lane in range(32):
                base, wi, bits, acc = gbase[g] + int(off[g, s, lane]), 0, words[lane][0], 0.0
                own = (counts[lane] + 3) // 4  # past its run a lane loads nothing: zeros
                for i in range(quads):
                    for v in (vals[base + i, lane].tolist() if i < own else [0.0] * 4):
                        while bits == 0:
                            wi += 1
                            bits = words[lane][wi]
                        hb = bits.bit_length() - 1
                        bits ^= 1 << hb
                        acc += v * float(xs[32 * wi + hb])
                y[32 * g + lane] += acc
    return y[:m]


def check():
    torch.manual_seed(0)
    for (m, k, dens, sl) in [(5, 70, 0.5, 32), (40, 1000, 0.3, 256), (33, 300, 0.05, 128), (4, 2048, 0.9, 512),
                             (6, 500, 0.5, 96), (2, 64, 0.0, 64), (3, 64, 1.0, 64), (70, 130, 0.1, 64)]:
        w = torch.randn(m, k) * (torch.rand(m, k) < dens)
        w[0, :] = 0
        if m > 2:
            w[2, :] = 0
            w[2, k // 2] = 1.5  # one nonzero
        w = w.half().float()
        x = torch.randn(k)
        got = emulate(pack(w, sl), x)
        want = w.double() @ x.double()
        assert torch.allclose(got, want, atol=1e-9), (m, k, dens, sl, (got - want).abs().max())
    print("emulation matches the dense product in every case")


_mods = {}


def kernels(warps, pf, bf16):
    key = (warps, pf, bf16)
    if key not in _mods:
        _mods[key] = compiled(SRC, "rowlane_walk", (f"-DWARPS={warps}", f"-DPF={pf}") + (("-DBF16",) if bf16 else ()))
    return _mods[key]


def smem_bytes(p, warps) -> int:
    return 2 * p["slice"] * 4 + warps * 2 * (p["slice"] // 32) * 32 * 4


def launch(fns, p, x, y, ws, done, warps):
    """One call: ws (fp32, m) and done (int32, one counter a row block) start zeroed and are left so."""
    import cupy as cp
    fn, _ = fns
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    args = (cp.uint64(p["bm"].data_ptr()), cp.uint64(p["vals"].data_ptr()), cp.uint64(p["gbase"].data_ptr()),
            cp.uint64(p["off"].data_ptr()), cp.uint64(x.data_ptr()), cp.uint64(ws.data_ptr()),
            cp.uint64(y.data_ptr()), cp.uint64(done.data_ptr()), cp.int32(p["m"]), cp.int32(p["k"]),
            cp.int32(p["S"]), cp.int32(p["slice"]))
    fn((-(-p["G"] // warps), p["S"]), (32 * warps,), args, shared_mem=smem_bytes(p, warps), stream=stream)


def main():
    if "--check" in sys.argv:
        return check()
    out = sys.argv[1]
    dtype = torch.bfloat16 if os.environ.get("BF16") else torch.float16
    shapes = [tuple(int(v) for v in a.split("x")) for a in
              os.environ.get("SHAPES", "4096x4096 14336x4096 4096x14336 1024x4096").split()]
    sps = [float(a) for a in os.environ.get("SPS", "0.5 0.7 0.9").split()]
    results = []
    for (m, k) in shapes:
        for s in sps:
            w, x, ref, dense = pruned_case(m, k, s, dtype)
            rows = []
            for sl in [int(a) for a in os.environ.get("SLICES", "128 256 512 1024").split()]:
                if sl > 32 * -(-k // 32) * 2:
                    continue
                torch.cuda.synchronize(); t0 = time.perf_counter()
                p = pack(w, sl); torch.cuda.synchronize(); pack_s = time.perf_counter() - t0
                sb, rb = nbytes(p), read_bytes(p)
                reps = [p] + [{q: (v.clone() if torch.is_tensor(v) else v) for q, v in p.items()}
                              for _ in range(math.ceil(256e6 / sb) - 1)]
                ws = torch.zeros(m, device="cuda", dtype=torch.float32)
                done = torch.zeros(p["G"], device="cuda", dtype=torch.int32)  # a counter a row block (any warps)
                for warps in [int(a) for a in os.environ.get("WARPS", "4 8").split()]:
                    if smem_bytes(p, warps) > 227 * 1024 - 16:
                        continue
                    for pf in [int(a) for a in os.environ.get("PFS", "4 8").split()]:
                        fns = kernels(warps, pf, dtype == torch.bfloat16)
                        y = torch.full((1, m), float("nan"), device="cuda", dtype=dtype)
                        launch(fns, p, x, y, ws, done, warps); torch.cuda.synchronize()
                        err = ((y.view(-1).double() - ref).norm() / ref.norm()).item()
                        # and the workspace and counters left zeroed for the next call
                        ok = bool(torch.isfinite(y).all()) and err < 4e-3 and not ws.any() and not done.any()
                        us = graph_us([lambda q=q: launch(fns, q, x, y, ws, done, warps) for q in reps], reps=9)
                        rows.append(dict(slice=sl, warps=warps, pf=pf, us=us, ok=ok, err=err, tbps=rb / us / 1e6,
                                         pack_s=pack_s, compile_s=fns[1], regs=fns[0].num_regs,
                                         bytes_per_weight=sb / (m * k), read_bytes_per_weight=rb / (m * k)))
                del reps
            best = min((r for r in rows if r["ok"]), key=lambda r: r["us"], default=None)
            bad = [r for r in rows if not r["ok"]]
            res = dict(m=m, k=k, sparsity=s, n=1, dtype=str(dtype).replace("torch.", ""), cublas_us=dense,
                       cublas_tbps=m * k * 2 / dense / 1e6, best=best, speedup=dense / best["us"] if best else None,
                       wrong=len(bad), configs=len(rows), rows=rows)
            results.append(res)
            print(f"{res['dtype']} N=1 {m}x{k} {s:.0%}: cuBLAS {dense:.2f} us ({res['cublas_tbps']:.2f} TB/s) | "
                  f"rowlane {best['us'] if best else float('nan'):.2f} us ({best['tbps'] if best else 0:.2f} TB/s) "
                  f"x{res['speedup'] or 0:.2f} wrong {len(bad)}/{len(rows)} best "
                  f"{best and {q: best[q] for q in ('slice', 'warps', 'pf', 'regs', 'read_bytes_per_weight')}}",
                  flush=True)
            with open(out, "w") as f:
                json.dump(dict(provenance(sys.argv), summary=summary_rows(results), results=results), f, indent=1)


if __name__ == "__main__":
    main()
