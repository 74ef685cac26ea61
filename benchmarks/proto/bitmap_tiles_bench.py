"""Design measurement of the bitmap-tile decode kernel (bitmap_tiles.cu: direct loads; bitmap_tiles_streamed.cu: cp.async-staged) against cuBLAS, weights resident in L2
and rotated through HBM, outputs checked against float64 into NaN-poisoned buffers. Runs on a GPU with cupy."""
import argparse, json, math, os, sys, time
import cupy as cp
import torch

from proto_timing import graph_us

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = open(os.path.join(HERE, "bitmap_tiles.cu")).read()
SRC2 = open(os.path.join(HERE, "bitmap_tiles_streamed.cu")).read()
GROUP = 16
_mods = {}


def kernel(nt, unroll, bf16):
    key = (nt, unroll, bf16)
    if key not in _mods:
        maxt = 512 if nt <= 2 else 256
        opts = ("-std=c++17", "-arch=sm_90", f"-DNT={nt}", f"-DUNROLL={unroll}", f"-DMAXT={maxt}", f"-DGROUP={GROUP}") + (("-DBF16",) if bf16 else ())
        t0 = time.perf_counter()
        mod = cp.RawModule(code=SRC, options=opts, name_expressions=None)
        fn = mod.get_function("bitmap_tiles_nk")
        _mods[key] = (fn, maxt, time.perf_counter() - t0)
    return _mods[key]


def kernel2(nt, stages, bf16, maxt):
    key = ("v2", nt, stages, bf16, maxt)
    if key not in _mods:
        opts = ("-std=c++17", "-arch=sm_90", f"-DNT={nt}", f"-DSTAGES={stages}", f"-DMAXT={maxt}") + (("-DBF16",) if bf16 else ())
        t0 = time.perf_counter()
        fn = cp.RawModule(code=SRC2, options=opts).get_function("bitmap_tiles_stream")
        _mods[key] = (fn, time.perf_counter() - t0)
    return _mods[key]


def lane_slots(device):
    """(row, col) in a 16 x 16 fragment of lane L's slot i (A register i >> 1, half i & 1) of mma.m16n8k16."""
    lane = torch.arange(32, device=device)[:, None]
    i = torch.arange(8, device=device)[None, :]
    g, t, j, h = lane // 4, lane % 4, i // 2, i % 2
    return g + 8 * (j % 2), 2 * t + h + 8 * (j // 2)


def pack_lane_major(w):
    """Lane-major fragments: per 16 x 16 fragment 8 uint32 words (word g, byte t: lane 4g + t's slot bits) and the
    values lane after lane, slot order. Same return shape as pack()."""
    m, k = w.shape
    mp, kp = -(-m // 16) * 16, -(-k // 16) * 16
    wp = torch.zeros(mp, kp, dtype=w.dtype, device=w.device)
    wp[:m, :k] = w
    s, c = mp // 16, kp // 16
    frag = wp.view(s, 16, c, 16).permute(0, 2, 1, 3)  # [s, c, row, col]
    rows, cols = lane_slots(w.device)
    f = frag[:, :, rows, cols]  # [s, c, 32, 8]
    mask = f != 0
    lane_bytes = (mask.to(torch.int64) << torch.arange(8, device=w.device)).sum(-1)  # [s, c, 32]
    words = (lane_bytes.view(s, c, 8, 4) << (8 * torch.arange(4, device=w.device))).sum(-1).to(torch.int64)
    words = words.to(torch.int32) if False else (words - ((words >= 2**31).to(torch.int64) << 32)).to(torch.int32)
    values = f[mask].contiguous()
    counts = mask.sum((2, 3)).view(-1)
    starts = torch.zeros(s * c + 1, dtype=torch.int64, device=w.device)
    starts[1:] = counts.cumsum(0)
    groups = -(-c // GROUP)
    idx = (torch.arange(s, device=w.device)[:, None] * c + torch.arange(groups, device=w.device)[None, :] * GROUP)
    offsets = starts[idx.view(-1)].to(torch.int32).view(s, groups)
    return words.contiguous(), values, offsets.contiguous(), c, groups


LANE_MAJOR = False


def pack2(w):
    """v2 layout: flat offsets [S * G + 1] (value index, 8 pad values first and last), max aligned group bytes."""
    bits, values, offsets, c, groups = (pack_lane_major if LANE_MAJOR else pack)(w)
    s = bits.shape[0]
    vals = torch.zeros(values.numel() + 16, dtype=values.dtype, device=values.device)
    vals[8:8 + values.numel()] = values
    flat = torch.empty(s * groups + 1, dtype=torch.int64, device=values.device)
    flat[:-1] = offsets.view(-1).to(torch.int64) + 8
    flat[-1] = values.numel() + 8
    a0 = flat[:-1] & ~7
    nbytes_g = ((flat[1:] - a0 + 7) // 8) * 16
    slot = GROUP * 32 + int(nbytes_g.max().item()) + 16  # +16: branch-free reads one past a stage
    slot = -(-slot // 16) * 16
    return bits, vals, flat.to(torch.int32).contiguous(), c, groups, slot


def launch2(fn, packed, x, y, m, k, n, nt, warps, kw, stages, slot=None):
    bits, values, offsets, c, groups, slot0 = packed
    slot = slot or slot0
    gpw = -(-groups // kw)
    spb = warps // kw
    strips = -(-m // 16)
    smem = spb * 16 * 8 * nt * 4 + (5120 if LANE_MAJOR else 0) + warps * stages * slot
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    args = (cp.uint64(bits.data_ptr()), cp.uint64(values.data_ptr()), cp.uint64(offsets.data_ptr()), cp.uint64(x.data_ptr()),
            cp.uint64(y.data_ptr()), cp.uint64(0), cp.int32(m), cp.int32(k), cp.int32(n), cp.int32(c), cp.int32(groups),
            cp.int32(kw), cp.int32(gpw), cp.int32(slot))
    fn((-(-strips // spb),), (32 * warps,), args, shared_mem=smem, stream=stream)


def pack(w):
    """W (M x K, on the GPU, zeros = pruned) -> bitmaps [S][C][4] int64, values (packed, fragment order), offsets [S][G]."""
    m, k = w.shape
    mp, kp = -(-m // 16) * 16, -(-k // 16) * 16
    wp = torch.zeros(mp, kp, dtype=w.dtype, device=w.device)
    wp[:m, :k] = w
    s, c = mp // 16, kp // 16
    t = wp.view(s, 2, 8, c, 2, 8).permute(0, 3, 4, 1, 2, 5).reshape(s, c, 4, 64)  # [s, c, qh, rh, rl, ql]
    mask = t != 0
    bits = (mask.to(torch.int64) << torch.arange(64, device=w.device)).sum(-1)  # two's complement: exact
    values = t[mask].contiguous()
    counts = mask.sum((2, 3)).view(-1)  # per fragment
    starts = torch.zeros(s * c + 1, dtype=torch.int64, device=w.device)
    starts[1:] = counts.cumsum(0)
    groups = -(-c // GROUP)
    idx = (torch.arange(s, device=w.device)[:, None] * c + torch.arange(groups, device=w.device)[None, :] * GROUP)
    offsets = starts[idx.view(-1)].to(torch.int32).view(s, groups)
    return bits.contiguous(), values, offsets.contiguous(), c, groups


def nbytes(*ts):
    return sum(t.numel() * t.element_size() for t in ts)


def launch(fn, maxt, packed, x, y, m, k, n, kw, spb, nt):
    bits, values, offsets, c, groups = packed
    gpw = -(-groups // kw)
    strips = -(-m // 16)
    grid = (-(-strips // spb),)
    block = (32 * kw * spb,)
    smem = spb * 16 * 8 * nt * 4
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    args = (cp.uint64(bits.data_ptr()), cp.uint64(values.data_ptr()), cp.uint64(offsets.data_ptr()), cp.uint64(x.data_ptr()),
            cp.uint64(y.data_ptr()), cp.uint64(0), cp.int32(m), cp.int32(k), cp.int32(n), cp.int32(c), cp.int32(groups),
            cp.int32(kw), cp.int32(gpw))
    fn(grid, block, args, shared_mem=smem, stream=stream)


def run_case(m, k, n, sparsity, dtype, rotate_bytes=400e6, configs=None, seed=0, skew=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.float32)
    score = w.abs() * (torch.rand(1, k, device="cuda", generator=gen) * 3 + 0.1 if skew else 1)
    keep = max(1, round(k * (1 - sparsity)))
    thr = score.topk(keep, dim=1).values[:, -1:]
    w = torch.where(score >= thr, w, torch.zeros_like(w)).to(dtype)
    t0 = time.perf_counter(); packed = pack(w); torch.cuda.synchronize(); pack_s = time.perf_counter() - t0
    sparse_bytes = nbytes(packed[0], packed[1], packed[2])
    dense_bytes = m * k * 2
    nt = min(8, -(-n // 8))
    bf16 = dtype == torch.bfloat16
    x = torch.randn(n, k, device="cuda", generator=gen).to(dtype)
    ref = (x.double() @ w.double().t())
    copies = max(2, math.ceil(rotate_bytes / dense_bytes))
    dense_ws = [w.clone() for _ in range(copies)]
    ys = torch.empty(n, m, device="cuda", dtype=dtype)
    dense_rot = graph_us([lambda wi=wi: torch.matmul(x, wi.t(), out=ys) for wi in dense_ws])
    dense_res = graph_us([lambda: torch.matmul(x, w.t(), out=ys)] * copies)
    del dense_ws
    if VARIANT == "v2":
        return run_v2(m, k, n, sparsity, dtype, w, x, ref, packed, dense_rot, dense_res, dense_bytes, pack_s, rotate_bytes, skew)
    scopies = [packed] + [tuple(t.clone() if torch.is_tensor(t) else t for t in packed) for _ in range(max(1, math.ceil(rotate_bytes / sparse_bytes)) - 1)]
    best = None
    rows = []
    strips = -(-m // 16)
    for unroll, kw in (configs or [(4, 4), (4, 8), (8, 4), (8, 8), (4, 16)]):
        if kw * 32 > (512 if nt <= 2 else 256):
            continue
        fn, maxt, comp_s = kernel(nt, unroll, bf16)
        spb = max(1, (maxt // 2) // (32 * kw)) if kw * 32 <= maxt // 2 else 1
        y = torch.full((n, m), float("nan"), device="cuda", dtype=dtype)
        launch(fn, maxt, packed, x, y, m, k, n, kw, spb, nt)
        torch.cuda.synchronize()
        err = ((y.double() - ref).norm() / ref.norm()).item()
        ok = bool(torch.isfinite(y).all().item()) and err < (4e-3 if not bf16 else 3e-2)
        rot = graph_us([lambda p=p: launch(fn, maxt, p, x, y, m, k, n, kw, spb, nt) for p in scopies])
        res = graph_us([lambda: launch(fn, maxt, packed, x, y, m, k, n, kw, spb, nt)] * len(scopies))
        row = dict(unroll=unroll, kw=kw, spb=spb, us_rotating=rot, us_resident=res, rel_error=err, ok=ok,
                   tbps_rotating=sparse_bytes / rot / 1e6, compile_s=comp_s)
        rows.append(row)
        if ok and (best is None or rot < best["us_rotating"]):
            best = row
    return dict(M=m, K=k, n=n, sparsity=sparsity, dtype=str(dtype).split(".")[-1], skew=skew,
                bytes_per_weight=sparse_bytes / (m * k), pack_s=pack_s,
                dense_us_rotating=dense_rot, dense_us_resident=dense_res, dense_tbps_rotating=dense_bytes / dense_rot / 1e6,
                best=best, speedup_rotating=dense_rot / best["us_rotating"] if best else None,
                speedup_resident=dense_res / best["us_resident"] if best else None, configs=rows)


VARIANT = "v2"


def run_v2(m, k, n, sparsity, dtype, w, x, ref, packed1, dense_rot, dense_res, dense_bytes, pack_s, rotate_bytes, skew):
    packed = pack2(w)
    bits, vals, flat, c, groups, slot = packed
    sparse_bytes = nbytes(bits, vals, flat)
    nt = min(8, -(-n // 8))
    bf16 = dtype == torch.bfloat16
    scopies = [packed] + [tuple(t.clone() if torch.is_tensor(t) else t for t in packed) for _ in range(max(1, math.ceil(rotate_bytes / sparse_bytes)) - 1)]
    strips = -(-m // 16)
    rows, best = [], None
    for stages in (3, 4):
        for warps in (4, 8, 16):
            for kw in (1, 2, 4, 8, 16):
                if kw > warps or warps * 32 > (512 if nt <= 2 else 256):
                    continue
                smem = (warps // kw) * 16 * 8 * nt * 4 + warps * stages * slot
                if smem > 227 * 1024:
                    continue
                total_warps = -(-strips // (warps // kw)) * warps
                if total_warps < 132 * 4 or total_warps > 132 * 64:
                    continue
                maxt = 512 if nt <= 2 else 256
                fn, comp_s = kernel2(nt, stages, bf16, maxt)
                fn.max_dynamic_shared_size_bytes = 227 * 1024
                y = torch.full((n, m), float("nan"), device="cuda", dtype=dtype)
                launch2(fn, packed, x, y, m, k, n, nt, warps, kw, stages)
                torch.cuda.synchronize()
                err = ((y.double() - ref).norm() / ref.norm()).item()
                ok = bool(torch.isfinite(y).all().item()) and err < (4e-3 if not bf16 else 3e-2)
                rot = graph_us([lambda p=p: launch2(fn, p, x, y, m, k, n, nt, warps, kw, stages) for p in scopies])
                res = graph_us([lambda: launch2(fn, packed, x, y, m, k, n, nt, warps, kw, stages)] * len(scopies))
                row = dict(stages=stages, warps=warps, kw=kw, us_rotating=rot, us_resident=res, rel_error=err, ok=ok,
                           tbps_rotating=sparse_bytes / rot / 1e6, compile_s=comp_s)
                rows.append(row)
                if ok and (best is None or rot < best["us_rotating"]):
                    best = row
    return dict(M=m, K=k, n=n, sparsity=sparsity, dtype=str(dtype).split(".")[-1], skew=skew,
                bytes_per_weight=sparse_bytes / (m * k), pack_s=pack_s,
                dense_us_rotating=dense_rot, dense_us_resident=dense_res, dense_tbps_rotating=dense_bytes / dense_rot / 1e6,
                best=best, speedup_rotating=dense_rot / best["us_rotating"] if best else None,
                speedup_resident=dense_res / best["us_resident"] if best else None, configs=rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shapes", default="4096x4096,14336x4096,4096x14336,1024x4096")
    ap.add_argument("--n", default="1,8,16,64")
    ap.add_argument("--sparsity", default="0.5,0.7,0.9")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--skew", action="store_true")
    a = ap.parse_args()
    results = []
    for dt in a.dtype.split(","):
        for n in map(int, a.n.split(",")):
            for shape in a.shapes.split(","):
                m, k = map(int, shape.split("x"))
                for s in map(float, a.sparsity.split(",")):
                    r = run_case(m, k, n, s, getattr(torch, dt), skew=a.skew)
                    results.append(r)
                    b = r["best"] or {}
                    print(f"{dt} N={n:3d} {m}x{k} s={s:.1f}: dense {r['dense_us_rotating']:.1f}us ({r['dense_tbps_rotating']:.2f}TB/s) "
                          f"bmt {b.get('us_rotating', float('nan')):.1f}us ({b.get('tbps_rotating', 0):.2f}TB/s) "
                          f"x{(r['speedup_rotating'] or 0):.2f} rot, x{(r['speedup_resident'] or 0):.2f} res "
                          f"[s{b.get('stages')} w{b.get('warps')} kw{b.get('kw')}] B/w {r['bytes_per_weight']:.3f} err {b.get('rel_error', -1):.1e} "
                          f"bad={sum(not c['ok'] for c in r['configs'])}", flush=True)
                    json.dump(dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), results=results),
                              open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
