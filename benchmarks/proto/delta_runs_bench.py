"""The 8-bit-delta run decode (delta_runs.cu) against cuBLAS at N = 1: weights rotated through HBM, outputs
NaN-poisoned and checked against float64, a sweep of warps a block / quads loaded ahead per case. `--check`
decodes the packed format on the CPU back to W (no GPU needed).

Knobs (environment): SHAPES ("4096x4096 14336x4096 4096x14336 1024x4096"), SPS ("0.5 0.7 0.9"), WARPS
("4 8"), US ("2 4 8"), BF16=1, e.g.
    SHAPES=4096x4096 SPS=0.5 python3 benchmarks/proto/delta_runs_bench.py /tmp/delta_runs.json"""
import json, math, os, sys, time
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = open(os.path.join(HERE, "delta_runs.cu")).read()
sys.path.insert(0, HERE)
from proto_timing import compiled, graph_us, pruned_case, summary_rows  # noqa: E402
MAX_GAP = 255


def pack(w: torch.Tensor) -> dict:
    """delta_runs.cu's format, built by torch ops on w's device (see the kernel's header)."""
    m, k = w.shape
    dev = w.device
    if k > 65536:
        raise ValueError("16-bit run bases: K <= 65536")
    rows, cols = (w != 0).nonzero(as_tuple=True)                       # row-major, columns ascending
    vals = w[rows, cols]
    nnz = rows.numel()
    same_row = torch.zeros(nnz, dtype=torch.bool, device=dev)
    same_row[1:] = rows[1:] == rows[:-1]
    prev = torch.zeros_like(cols)
    prev[1:] = cols[:-1]
    gap = torch.where(same_row, cols - prev, torch.zeros_like(cols))
    fill = torch.clamp((gap - 1) // MAX_GAP, min=0)                      # fillers before an entry
    if int(fill.sum()):
        # entry e moves past the fillers before it; filler j (1..f) of entry e sits at prev + 255 j
        where = torch.arange(nnz, device=dev) + torch.cumsum(fill, 0)
        total = nnz + int(fill.sum())
        owner = torch.repeat_interleave(torch.arange(nnz, device=dev), fill)
        j = torch.arange(owner.numel(), device=dev) - (torch.cumsum(fill, 0) - fill)[owner] + 1
        r2, c2 = torch.empty(total, dtype=rows.dtype, device=dev), torch.empty(total, dtype=cols.dtype, device=dev)
        v2 = torch.zeros(total, dtype=vals.dtype, device=dev)
        r2[where], c2[where], v2[where] = rows, cols, vals
        fpos = where[owner] - fill[owner] + j - 1
        r2[fpos], c2[fpos] = rows[owner], prev[owner] + MAX_GAP * j
        rows, cols, vals = r2, c2, v2
    count = torch.bincount(rows, minlength=m)                            # entries a row
    quads = (count + 3) // 4
    qbase = torch.cumsum(quads, 0) - quads
    ebase = torch.cumsum(count, 0) - count
    total_q = max(int(quads.sum()), 1)
    j = torch.arange(rows.numel(), device=dev) - ebase[rows]            # entry within its row
    q = j // 4
    c, rem = (quads >> 5)[rows], (quads & 31)[rows]
    long_part = rem * (c + 1)                                            # quads of the lanes with one more
    in_long = q < long_part
    lane = torch.where(in_long, q // (c + 1), rem + (q - long_part) // torch.clamp(c, min=1))
    i = torch.where(in_long, q % (c + 1), (q - long_part) % torch.clamp(c, min=1))
    slot = qbase[rows] + 32 * i + lane                                   # the quad's place
    gaps = torch.zeros(total_q * 4, dtype=torch.int64, device=dev)
    vbuf = torch.zeros(total_q * 4, dtype=w.dtype, device=dev)
    first = torch.ones(rows.numel(), dtype=torch.bool, device=dev)       # a run's first entry
    run = rows * 32 + lane
    first[1:] = run[1:] != run[:-1]
    pc = torch.zeros_like(cols)
    pc[1:] = cols[:-1]
    d = torch.where(first, torch.zeros_like(cols), cols - pc)
    assert d.numel() == 0 or (int(d.max()) <= MAX_GAP and int(d.min()) >= 0)
    at = slot * 4 + j % 4
    gaps[at], vbuf[at] = d, vals
    bases = torch.zeros(m * 32, dtype=torch.int64, device=dev)
    bases[run[first]] = cols[first]
    # the last quad's padding: value 0, gap 0 (its run's last column)
    g = gaps.view(total_q, 4)
    words = g[:, 0] | (g[:, 1] << 8) | (g[:, 2] << 16) | (g[:, 3] << 24)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    bases = torch.where(bases >= 2 ** 15, bases - 2 ** 16, bases).to(torch.int16)  # uint16 bits
    rowinfo = torch.stack([qbase, quads], 1).to(torch.int32).contiguous()
    return dict(gaps=words, vals=vbuf, rows=rowinfo, bases=bases, m=m, k=k, quads=total_q,
                fillers=int(fill.sum()))


def nbytes(p) -> int:
    return sum(p[q].numel() * p[q].element_size() for q in ("gaps", "vals", "rows", "bases"))


def unpack(p) -> torch.Tensor:
    """W (float64, on the CPU) read back the way the kernel walks it."""
    m, k = p["m"], p["k"]
    gaps = p["gaps"].cpu().to(torch.int64) & 0xffffffff
    vals = p["vals"].cpu().double().view(-1, 4)
    rows = p["rows"].cpu().tolist()
    bases = (p["bases"].cpu().to(torch.int64) & 0xffff).view(m, 32)
    w = torch.zeros(m, k, dtype=torch.float64)
    for r in range(m):
        qb, quads = rows[r]
        c, rem = quads >> 5, quads & 31
        for lane in range(32):
            col = int(bases[r, lane])
            for i in range(c + (lane < rem)):
                word = int(gaps[qb + 32 * i + lane])
                for e in range(4):
                    col += (word >> (8 * e)) & 255
                    w[r, col] += float(vals[qb + 32 * i + lane, e])
    return w


def check():
    torch.manual_seed(0)
    for (m, k, dens) in [(5, 70, 0.5), (40, 1000, 0.3), (33, 3000, 0.002), (4, 2048, 0.9), (2, 64, 0.0),
                         (3, 64, 1.0), (70, 130, 0.1), (3, 1200, 0.004)]:
        w = torch.randn(m, k) * (torch.rand(m, k) < dens)
        w[0, :] = 0
        if m > 2:
            w[2, :] = 0
            w[2, k - 1] = 1.5  # one nonzero, far from column 0
        w = w.half()
        p = pack(w)
        got = unpack(p)
        assert torch.equal(got, w.double()), (m, k, dens)
    print("the format reads back to W in every case")


_mods = {}


def kernels(warps, u, bf16):
    key = (warps, u, bf16)
    if key not in _mods:
        _mods[key] = compiled(SRC, "delta_runs", (f"-DWARPS={warps}", f"-DAHEAD={u}") + (("-DBF16",) if bf16 else ()))
    return _mods[key]


def launch(fns, p, x, y, warps):
    import cupy as cp
    fn, _ = fns
    stream = cp.cuda.Stream.from_external(torch.cuda.current_stream()) if hasattr(cp.cuda.Stream, "from_external") \
        else cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    args = (cp.uint64(p["gaps"].data_ptr()), cp.uint64(p["vals"].data_ptr()), cp.uint64(p["rows"].data_ptr()),
            cp.uint64(p["bases"].data_ptr()), cp.uint64(x.data_ptr()), cp.uint64(y.data_ptr()),
            cp.int32(p["m"]), cp.int32(p["k"]))
    fn((-(-p["m"] // warps),), (32 * warps,), args, shared_mem=p["k"] * 4, stream=stream)


def main():
    if "--check" in sys.argv:
        return check()
    from sparseforge.bench.report import provenance
    out = sys.argv[1]
    dtype = torch.bfloat16 if os.environ.get("BF16") else torch.float16
    shapes = [tuple(int(v) for v in a.split("x")) for a in
              os.environ.get("SHAPES", "4096x4096 14336x4096 4096x14336 1024x4096").split()]
    sps = [float(a) for a in os.environ.get("SPS", "0.5 0.7 0.9").split()]
    results = []
    for (m, k) in shapes:
        for s in sps:
            w, x, ref, dense = pruned_case(m, k, s, dtype)
            torch.cuda.synchronize(); t0 = time.perf_counter()
            p = pack(w); torch.cuda.synchronize(); pack_s = time.perf_counter() - t0
            sb = nbytes(p)
            reps = [p] + [{q: (v.clone() if torch.is_tensor(v) else v) for q, v in p.items()}
                          for _ in range(math.ceil(256e6 / sb) - 1)]
            rows = []
            for warps in [int(a) for a in os.environ.get("WARPS", "4 8").split()]:
                for u in [int(a) for a in os.environ.get("US", "2 4 8").split()]:
                    fns = kernels(warps, u, dtype == torch.bfloat16)
                    y = torch.full((1, m), float("nan"), device="cuda", dtype=dtype)
                    launch(fns, p, x, y, warps); torch.cuda.synchronize()
                    err = ((y.view(-1).double() - ref).norm() / ref.norm()).item()
                    ok = bool(torch.isfinite(y).all()) and err < 4e-3
                    us = graph_us([lambda q=q: launch(fns, q, x, y, warps) for q in reps], reps=9)
                    rows.append(dict(warps=warps, u=u, us=us, ok=ok, err=err, tbps=sb / us / 1e6, pack_s=pack_s,
                                     compile_s=fns[1], regs=fns[0].num_regs, bytes_per_weight=sb / (m * k)))
            del reps
            best = min((r for r in rows if r["ok"]), key=lambda r: r["us"], default=None)
            bad = [r for r in rows if not r["ok"]]
            res = dict(m=m, k=k, sparsity=s, n=1, dtype=str(dtype).replace("torch.", ""), cublas_us=dense,
                       cublas_tbps=m * k * 2 / dense / 1e6, best=best, speedup=dense / best["us"] if best else None,
                       fillers=p["fillers"], wrong=len(bad), configs=len(rows), rows=rows)
            results.append(res)
            print(f"{res['dtype']} N=1 {m}x{k} {s:.0%}: cuBLAS {dense:.2f} us ({res['cublas_tbps']:.2f} TB/s) | "
                  f"delta-runs {best['us'] if best else float('nan'):.2f} us ({best['tbps'] if best else 0:.2f} TB/s) "
                  f"x{res['speedup'] or 0:.2f} wrong {len(bad)}/{len(rows)} best "
                  f"{best and {q: best[q] for q in ('warps', 'u', 'regs', 'bytes_per_weight')}}", flush=True)
            with open(out, "w") as f:
                json.dump(dict(provenance(sys.argv), summary=summary_rows(results), results=results), f, indent=1)


if __name__ == "__main__":
    main()
