"""The nonzero-driven bitmap decode (bitmap_walk.cu) against cuBLAS for N = 1..8 tokens: weights rotated
through HBM, outputs NaN-poisoned and checked against float64, a small sweep of warps / prefetch depth /
resident blocks per case. `--check` runs a CPU emulation of the kernel's lane arithmetic against the dense
matrix (no GPU needed).

Knobs (environment): NS, SHAPES ("4096x4096 ..."), SPS, PFS, WARPS, VARIANT=transposed
(bitmap_walk_transposed.cu) or VARIANT=rows (bitmap_walk_rows: persistent warps, the next row loaded while
this one is walked), DEFINES (extra -D flags), PROFILE=1 (the first case and config: one checked launch
and three more, then exit), e.g.
    PROFILE=1 NS=1 SHAPES=4096x4096 SPS=0.5 PFS=4 WARPS=16 ncu --kernel-name bitmap_walk --launch-skip 1 \
        --launch-count 1 --set full python3 benchmarks/proto/bitmap_walk_bench.py /tmp/unused.json"""
import json, math, os, sys, time
import torch

from proto_timing import graph_us

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = open(os.path.join(HERE, "bitmap_walk_transposed.cu" if os.environ.get("VARIANT") == "transposed"
                        else "bitmap_walk.cu")).read()


def chunk_values(density: float) -> int:
    """Values a chunk: wide loads where rows are dense, little tail padding where they are sparse."""
    return 8 if density >= 0.25 else 4 if density >= 0.12 else 2


def pack(w: torch.Tensor, seg: int, c: int) -> dict:
    """The format of bitmap_walk.cu, built by torch ops on w's device."""
    m, k = w.shape
    nseg = -(-k // seg)
    wp = torch.zeros(m, nseg * seg, dtype=w.dtype, device=w.device)
    wp[:, :k] = w
    vr = wp.view(m, nseg, seg).permute(1, 0, 2).reshape(nseg * m, seg)     # virtual rows, segment-major
    mask = vr != 0
    nw = seg // 32
    shifts = (31 - torch.arange(32, device=w.device, dtype=torch.int64))
    words = (mask.view(-1, nw, 32).to(torch.int64) << shifts).sum(-1)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    cnt = mask.sum(1)
    nch = (cnt + c - 1) // c
    coff = torch.zeros(nseg * m + 1, dtype=torch.int64, device=w.device)
    coff[1:] = nch.cumsum(0)
    vrow, col = mask.nonzero(as_tuple=True)                    # row-major: columns ascending within a row
    start = torch.zeros_like(cnt)
    start[1:] = cnt.cumsum(0)[:-1]
    rank = torch.arange(vrow.numel(), device=w.device) - start[vrow]
    q, j = rank // c, rank % c
    n_ch = nch[vrow]
    qc = (n_ch + 31) // 32
    e = n_ch - 32 * (qc - 1)
    first = q < e * qc
    lane = torch.where(first, q // qc.clamp(min=1), e + (q - e * qc) // (qc - 1).clamp(min=1))
    r = torch.where(first, q % qc.clamp(min=1), (q - e * qc) % (qc - 1).clamp(min=1))
    pos = (coff[vrow] + r * 32 + lane) * c + j
    total = int(coff[-1].item()) * c
    vals = torch.zeros(max(total, c), dtype=w.dtype, device=w.device)
    vals[pos] = vr[vrow, col]
    return dict(bm=words.contiguous(), vals=vals, coff=coff.to(torch.int32).contiguous(), seg=seg, nseg=nseg,
                W=nw, c=c, m=m, k=k)


def nbytes(p):
    return sum(p[q].numel() * p[q].element_size() for q in ("bm", "vals", "coff"))


def emulate(p, x):
    """The kernel's arithmetic, lane by lane, on the CPU (float64): a check of format and search."""
    m, k, seg, nseg, W, c = p["m"], p["k"], p["seg"], p["nseg"], p["W"], p["c"]
    bm = p["bm"].cpu().to(torch.int64) & 0xffffffff
    vals, coff = p["vals"].cpu().double(), p["coff"].cpu().tolist()
    n = x.shape[0]
    y = torch.zeros(n, m, dtype=torch.float64)
    P = -(-W // 32)
    for s in range(nseg):
        xs = torch.zeros(n, seg + 32, dtype=torch.float64)
        hi = min(k, (s + 1) * seg)
        xs[:, :hi - s * seg] = x[:, s * seg:hi].double()
        for row in range(m):
            v = s * m + row
            words = [int(bm[v, i]) for i in range(W)]
            cnts = [sum(bin(words[i]).count("1") for i in range(l * P, min(W, l * P + P))) for l in range(32)]
            incl = list(torch.tensor(cnts).cumsum(0).tolist())
            base, nch = coff[v], coff[v + 1] - coff[v]
            qc = (nch + 31) // 32
            e = nch - 32 * (qc - 1)
            for lane in range(32):
                cl = 0 if nch == 0 else (qc if lane < e else qc - 1)
                if cl == 0:
                    continue
                t0 = (lane * (qc - 1) + min(lane, e)) * c
                o = 0
                for step in (16, 8, 4, 2, 1):
                    if incl[o + step - 1] <= t0:
                        o += step
                o = min(o, 31)
                rem, wi = t0 - (incl[o] - cnts[o]), o * P
                w = words[wi]
                while rem >= bin(w).count("1"):
                    rem -= bin(w).count("1")
                    wi += 1
                    w = words[wi]
                for _ in range(rem):
                    w &= 0x7fffffff >> (32 - w.bit_length())
                for r in range(cl):
                    for jj in range(c):
                        while w == 0:
                            wi += 1
                            w = words[wi] if wi < W else 0xffffffff
                        z = 32 - w.bit_length()
                        col = wi * 32 + z
                        w &= 0x7fffffff >> z
                        y[:, row] += vals[(base + r * 32 + lane) * c + jj] * xs[:, col]
    return y


def check():
    torch.manual_seed(0)
    for (m, k, dens, seg, n) in [(5, 70, 0.5, 96, 2), (9, 1000, 0.3, 1024, 1), (3, 300, 0.05, 128, 3),
                                 (4, 2048, 0.9, 2048, 2), (6, 5000, 0.5, 1024, 1), (2, 64, 0.0, 64, 1),
                                 (3, 64, 1.0, 64, 1), (7, 4100, 0.1, 4128, 2)]:
        w = torch.randn(m, k) * (torch.rand(m, k) < dens)
        w[0, :] = 0
        if m > 2:
            w[2, :] = 0
            w[2, k // 2] = 1.5  # one nonzero
        x = torch.randn(n, k)
        for c in (2, 4, 8):
            p = pack(w.half().float(), seg, c)
            got = emulate(p, x)
            want = x.double() @ w.half().double().t()
            assert torch.allclose(got, want, atol=1e-9), (m, k, dens, seg, c, (got - want).abs().max())
    print("emulation matches the dense product in every case")


_mods = {}


ENTRY = "bitmap_walk_rows" if os.environ.get("VARIANT") == "rows" else "bitmap_walk"


def kernels(nt, c, pf, bf16, xhalf, pmax=16):
    import cupy as cp
    key = (nt, c, pf, bf16, xhalf, pmax)
    if key not in _mods:
        t0 = time.perf_counter()
        opts = ("-std=c++17", "-arch=sm_90", f"-DNT={nt}", f"-DC={c}", f"-DPF={pf}", "-DMAXT=512", f"-DPMAX={pmax}")
        opts += (("-DBF16",) if bf16 else ()) + (("-DXHALF",) if xhalf else ())
        opts += tuple(os.environ.get("DEFINES", "").split())  # e.g. DEFINES=-DSTAGE16
        mod = cp.RawModule(code=SRC, options=opts + (f"-I{HERE}",))  # bitmap_walk_common.cuh
        fn = mod.get_function(ENTRY)
        fn.max_dynamic_shared_size_bytes = 227 * 1024
        _mods[key] = (fn, mod.get_function("bitmap_walk_finish"), time.perf_counter() - t0)
    return _mods[key]


def smem_bytes(p, nt, warps, xhalf):
    xs = (p["seg"] + 32) * nt * (2 if xhalf else 4)
    return -(-xs // 16) * 16 + warps * p["W"] * 4


def launch(fns, p, x, y, ws, n, nt, warps, grid, xhalf):
    import cupy as cp
    fn, finish, _ = fns
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    args = (cp.uint64(p["bm"].data_ptr()), cp.uint64(p["vals"].data_ptr()), cp.uint64(p["coff"].data_ptr()),
            cp.uint64(x.data_ptr()), cp.uint64(y.data_ptr()), cp.uint64(ws.data_ptr()), cp.int32(p["m"]),
            cp.int32(p["k"]), cp.int32(n), cp.int32(p["seg"]), cp.int32(p["nseg"]), cp.int32(p["W"]))
    fn((grid,), (32 * warps,), args, shared_mem=smem_bytes(p, nt, warps, xhalf), stream=stream)
    if p["nseg"] > 1:
        count = n * p["m"]
        finish((-(-count // 256),), (256,), (cp.uint64(ws.data_ptr()), cp.uint64(y.data_ptr()), cp.int32(count)),
               stream=stream)


def main():
    if "--check" in sys.argv:
        return check()
    out = sys.argv[1]
    dtypes = [torch.bfloat16] if "--bf16" in sys.argv else [torch.float16]
    shapes = [tuple(int(v) for v in a.split("x")) for a in os.environ.get("SHAPES", "4096x4096 14336x4096 4096x14336 1024x4096").split()]
    ns = [int(a) for a in os.environ.get("NS", "1 8").split()]
    sps = [float(a) for a in os.environ.get("SPS", "0.5 0.7 0.9").split()]
    results = []
    for dtype in dtypes:
        bf16 = dtype == torch.bfloat16
        for n in ns:
            nt = 1 if n == 1 else 2 if n == 2 else 4 if n <= 4 else 8
            for (m, k) in shapes:
                for s in sps:
                    gen = torch.Generator(device="cuda").manual_seed(0)
                    w = torch.randn(m, k, device="cuda", generator=gen)
                    keep = round(k * (1 - s)); thr = w.abs().topk(keep, dim=1).values[:, -1:]
                    w = torch.where(w.abs() >= thr, w, torch.zeros_like(w)).to(dtype)
                    x = torch.randn(n, k, device="cuda", generator=gen).to(dtype)
                    ref = x.double() @ w.double().t()
                    ys = torch.empty(n, m, device="cuda", dtype=dtype)
                    dws = [w.clone() for _ in range(max(2, math.ceil(256e6 / (m * k * 2))))]
                    dense = graph_us([lambda wi=wi: torch.matmul(x, wi.t(), out=ys) for wi in dws], reps=9); del dws
                    c = chunk_values(1 - s)
                    rows = []
                    options = []  # (segment, x in fp16): x staged whole where it fits, else in segments
                    if nt * 4 * (k + 32) <= 100 * 1024:
                        options.append((128 * -(-k // 128), False))
                    if nt > 1 and nt * 2 * (k + 32) <= 100 * 1024:
                        options.append((128 * -(-k // 128), True))
                    if not options:
                        options.append((4096, nt > 1))
                    for seg, xh in options:
                        torch.cuda.synchronize(); t0 = time.perf_counter()
                        p = pack(w, seg, c); torch.cuda.synchronize(); pack_s = time.perf_counter() - t0
                        sb = nbytes(p)
                        reps = [p] + [{q: (v.clone() if torch.is_tensor(v) else v) for q, v in p.items()}
                                      for _ in range(math.ceil(256e6 / sb) - 1)]
                        ws = torch.zeros(n * m, device="cuda", dtype=torch.float32)
                        for pf in [int(a) for a in os.environ.get("PFS", "4 8").split()]:
                            fns = kernels(nt, c, pf, bf16, xh, -(-p["W"] // 32))
                            for warps in [int(a) for a in os.environ.get("WARPS", "4 8 16").split()]:
                                sm = smem_bytes(p, nt, warps, xh)
                                if sm > 227 * 1024:
                                    continue
                                groups = -(-m // warps)
                                if ENTRY == "bitmap_walk_rows":  # persistent: as many blocks as fit at once
                                    regs = max(fns[0].num_regs, 16)
                                    per_sm = max(1, min(2048 // (32 * warps), (228 * 1024) // (sm + 1024),
                                                        65536 // (regs * 32 * warps)))
                                    groups = min(groups, 132 * per_sm)
                                grid = groups * p["nseg"]
                                y = torch.full((n, m), float("nan"), device="cuda", dtype=dtype)
                                launch(fns, p, x, y, ws, n, nt, warps, grid, xh); torch.cuda.synchronize()
                                err = ((y.double() - ref).norm() / ref.norm()).item()
                                ok = bool(torch.isfinite(y).all()) and err < 4e-3
                                if os.environ.get("PROFILE"):  # one checked launch, then three for a profiler
                                    for _ in range(3):
                                        launch(fns, p, x, y, ws, n, nt, warps, grid, xh)
                                    torch.cuda.synchronize()
                                    print(f"profiled {m}x{k} {s:.0%} N={n} pf={pf} warps={warps} ok={ok} err={err:.1e}")
                                    return
                                us = graph_us([lambda q=q: launch(fns, q, x, y, ws, n, nt, warps, grid, xh)
                                               for q in reps], reps=9)
                                rows.append(dict(seg=seg, pf=pf, warps=warps, grid=grid, xhalf=xh, us=us, ok=ok,
                                                 err=err, tbps=sb / us / 1e6, pack_s=pack_s, compile_s=fns[2],
                                                 regs=fns[0].num_regs))
                        del reps
                    best = min((r for r in rows if r["ok"]), key=lambda r: r["us"], default=None)
                    bad = [r for r in rows if not r["ok"]]
                    res = dict(m=m, k=k, sparsity=s, n=n, dtype=str(dtype).replace("torch.", ""), c=c,
                               cublas_us=dense, cublas_tbps=m * k * 2 / dense / 1e6,
                               bytes_per_weight=sb / (m * k), best=best, speedup=dense / best["us"] if best else None,
                               wrong=len(bad), configs=len(rows))
                    results.append(res)
                    print(f"{res['dtype']} N={n} {m}x{k} {s:.0%}: cuBLAS {dense:.2f} us ({res['cublas_tbps']:.2f} TB/s) | "
                          f"walk {best['us'] if best else float('nan'):.2f} us ({best['tbps'] if best else 0:.2f} TB/s) "
                          f"x{res['speedup'] or 0:.2f} B/w {res['bytes_per_weight']:.3f} wrong {len(bad)}/{len(rows)} "
                          f"best {best and {q: best[q] for q in ('seg', 'pf', 'warps', 'xhalf', 'regs')}}", flush=True)
                    with open(out, "w") as f:
                        json.dump(dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"),
                                       command=" ".join(sys.argv), results=results), f, indent=1)


if __name__ == "__main__":
    main()
