"""Dense 1x1 convolutions of ResNet-50 at batch 1, three ways, in one process (the fp16 ResNet-50 gap): cuDNN on
an NCHW input, cuDNN on channels_last, and the same product as one cuBLAS GEMM on the NCHW input
(W [Cout x Cin] @ x [Cin x HW] is the NCHW output, no transposition). The converted fp16 ResNet-50 keeps ~23
1x1 layers dense in NCHW, where cuDNN's NCHW path is the slow one; if the GEMM is faster there, the dense path
of SparseConv2d (and FusedDenseConv2d) should take it. Graph replay, fresh inputs, medians; bias + ReLU
after each (as the converted model runs them).

    PYTHONPATH=src python benchmarks/dense_1x1_fp16.py OUT.json [--dtype float16] [--batch 1]
"""
import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from sparseforge.bench.report import provenance
from sparseforge.runtime.timing import graph_time_us

# (Cin, Cout, H = W of the input, stride): ResNet-50's 1x1 convolutions (bottleneck reduce / expand, shortcuts)
SHAPES = [(64, 64, 56, 1), (64, 256, 56, 1), (256, 64, 56, 1), (256, 128, 56, 1), (256, 512, 56, 2),
          (128, 512, 28, 1), (512, 128, 28, 1), (512, 256, 28, 1), (512, 1024, 28, 2), (256, 1024, 14, 1),
          (1024, 256, 14, 1), (1024, 512, 14, 1), (1024, 2048, 14, 2), (512, 2048, 7, 1), (2048, 512, 7, 1)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = True, False
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for cin, cout, size, stride in SHAPES:
        w = torch.randn(cout, cin, 1, 1, device="cuda", generator=g).to(dtype) / math.sqrt(cin)
        bias = torch.randn(cout, device="cuda", generator=g).to(dtype)
        xs = [torch.randn(args.batch, cin, size, size, device="cuda", generator=g).to(dtype) for _ in range(4)]
        xs_cl = [x.contiguous(memory_format=torch.channels_last) for x in xs]
        w_cl = w.contiguous(memory_format=torch.channels_last)
        w2 = w.view(cout, cin)

        def cudnn(x, weight=w):
            return F.relu(F.conv2d(x, weight, bias, stride))

        def gemm(x):
            if stride > 1:  # a strided 1x1 reads every stride-th pixel: the GEMM needs them gathered first
                x = x[:, :, ::stride, ::stride].contiguous()
            b, c, h, wd = x.shape
            y = torch.matmul(w2, x.view(b, c, h * wd))  # [b, Cout, HW]: NCHW
            return F.relu(y.add_(bias[:, None])).view(b, cout, h, wd)

        with torch.no_grad():
            reference = cudnn(xs[0]).double()
            error = ((gemm(xs[0]).double() - reference).norm() / reference.norm()).item()
            times = {"cudnn_nchw_us": graph_time_us(cudnn, xs), "cudnn_channels_last_us":
                     graph_time_us(lambda x: cudnn(x, w_cl), xs_cl), "gemm_nchw_us": graph_time_us(gemm, xs)}
        row = {"cin": cin, "cout": cout, "size": size, "stride": stride, "batch": args.batch, "dtype": args.dtype,
               **times, "gemm_rel_error_vs_cudnn": error,
               "gemm_speedup_vs_cudnn_nchw": times["cudnn_nchw_us"] / times["gemm_nchw_us"]}
        rows.append(row)
        print(f"{cin:5d}->{cout:5d} {size:3d}x{size:<3d} s{stride}: cuDNN NCHW {times['cudnn_nchw_us']:6.1f} us, "
              f"channels_last {times['cudnn_channels_last_us']:6.1f}, GEMM NCHW {times['gemm_nchw_us']:6.1f} "
              f"({row['gemm_speedup_vs_cudnn_nchw']:.2f}x; rel. err. {error:.1e})", flush=True)
    geomean = math.exp(sum(math.log(r["gemm_speedup_vs_cudnn_nchw"]) for r in rows) / len(rows))
    print(f"GEMM over cuDNN NCHW: geomean {geomean:.2f}x")
    summary = {"model": "resnet50_dense_1x1", "sparsity": 0.0, "dtype": args.dtype, "batch": args.batch,
               "layout": "nchw", "geomean_speedup_vs_cudnn": geomean, "baseline": "cuDNN NCHW (F.conv2d)",
               "gpu": torch.cuda.get_device_name()}
    args.out.write_text(json.dumps({"provenance": provenance(sys.argv), "summary": summary, "cases": rows},
                                   indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
