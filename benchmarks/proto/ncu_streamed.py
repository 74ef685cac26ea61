import sys, torch
sys.path.insert(0, "benchmarks/proto")
import cupy as cp
import bitmap_tiles_bench as B
SRC = open("benchmarks/proto/bitmap_tiles_streamed.cu").read()
B.GROUP = 4
fn = cp.RawModule(code=SRC, options=("-std=c++17", "-arch=sm_90", "-DNT=1", "-DSTAGES=2", "-DGROUP=4", "-DMAXT=512", "-DXSTAGE", "-lineinfo")).get_function("bitmap_tiles_stream")
fn.max_dynamic_shared_size_bytes = 227 * 1024
m = k = 4096
w = torch.randn(m, k, device="cuda"); w[torch.rand(m, k, device="cuda") < 0.5] = 0; w = w.half()
p = B.pack2(w); x = torch.randn(1, k, device="cuda").half(); y = torch.empty(1, m, device="cuda").half()
slotb = p[5] + 8 * 1 * (4 * 32 + 16)
for _ in range(3):
    B.launch2(fn, p, x, y, m, k, 1, 1, 16, 16, 2, slotb)
torch.cuda.synchronize(); print("ok")
