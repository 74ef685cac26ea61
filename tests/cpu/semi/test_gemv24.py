"""The packed 2:4 format and the GEMV kernel's decoding, checked on the CPU: pack/unpack, an emulation of
the kernel's per-chunk arithmetic (bit fields, prmt selectors) against the dense product, and ptxas."""
import re
import subprocess

import numpy as np
import pytest
import torch

from sparseforge.codegen.gemv24 import default_unroll, render_gemv24, render_unpack24
from sparseforge.prune import nm_mask
from sparseforge.runtime import find_tool
from sparseforge.semi import Sparse24Error
from sparseforge.semi.gemv import Gemv24
from sparseforge.semi.packed import pack_24, unpack_24


def weight_24(m, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(m, k, generator=g)
    w = w * nm_mask(w)
    w[0, :4] = 0                                   # a group with no nonzero
    w[1, 4:8] = torch.tensor([0.0, 0.0, 0.0, 1.5])  # a group with one, at the last position
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pack_unpack_round_trip_and_size(dtype):
    w = weight_24(48, 96, dtype)
    packed = pack_24(w)
    assert packed.values.shape == (48, 48) and packed.meta.shape == (48, 6) and packed.meta.dtype == torch.int16
    assert torch.equal(unpack_24(packed), w)
    assert packed.nbytes == 48 * 96 * 2 * 9 // 16


def _prmt(a: int, b: int, selector: int) -> int:
    data = a | (b << 32)
    out = 0
    for i in range(4):
        byte = (selector >> (4 * i)) & 7
        out |= ((data >> (8 * byte)) & 0xFF) << (8 * i)
    return out


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().astype(np.int64) & 0xFFFF


def _from_bits(bits: int, dtype) -> float:
    return float(torch.tensor([bits if bits < 1 << 15 else bits - (1 << 16)], dtype=torch.int16).view(dtype)[0])


def _decode_constants(text: str) -> list[tuple[int, int, int]]:
    """(bit offset, selector multiplier, selector addend) of each of a chunk's 8 values, read from the PTX."""
    fields = [int(v) for v in re.findall(r"bfe\.u32 %rp, %rm, (\d+), 2;", text)]
    selectors = [(int(a), int(b)) for a, b in re.findall(r"mad\.lo\.u32 %sel\d, %rp, (\d+), (\d+);", text)]
    assert len(fields) == len(selectors) and len(fields) % 8 == 0
    constants = [(f, a, b) for f, (a, b) in zip(fields, selectors)]
    assert all(constants[i:i + 8] == constants[:8] for i in range(0, len(constants), 8))  # every chunk alike
    return constants[:8]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_arithmetic_emulated_matches_dense(dtype):
    """What one lane does for a chunk, with the bit fields and prmt selectors taken from the generated PTX."""
    constants = _decode_constants(render_gemv24(str(dtype).replace("torch.", ""), 1, False).modules[0])
    m, k = 5, 64
    w = weight_24(m, k, dtype, seed=3)
    x = torch.randn(k).to(dtype)
    packed = pack_24(w)
    vals, meta, xb = _bits(packed.values), _bits(packed.meta), _bits(x)
    got = np.zeros(m)
    for row in range(m):
        for c in range(k // 16):
            v = [int(vals[row, c * 8 + 2 * j]) | int(vals[row, c * 8 + 2 * j + 1]) << 16 for j in range(4)]
            xw = [int(xb[c * 16 + 2 * i]) | int(xb[c * 16 + 2 * i + 1]) << 16 for i in range(8)]
            code = int(meta[row, c])
            for i, (field, times, plus) in enumerate(constants):
                j, s = divmod(i, 2)
                p = (code >> field) & 3
                weight = _from_bits((v[j] >> (16 * s)) & 0xFFFF, dtype)
                picked = _prmt(xw[2 * j], xw[2 * j + 1], p * times + plus) & 0xFFFF
                got[row] += weight * _from_bits(picked, dtype)
    ref = w.double() @ x.double()
    np.testing.assert_allclose(got, ref.numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("n,unroll", [(1, None), (3, None), (8, None), (16, None), (1, 1), (1, 4), (4, 4), (8, 4),
                                      (16, 2)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_ptx_assembles_without_spills(arch, dtype, n, unroll, bias):
    source = render_gemv24(dtype, n, bias, arch, unroll)
    text, chunks = source.modules[0], 2 * (default_unroll(n) if unroll is None else unroll)  # two register sets
    assert text.count("fma.rn.f32") == 8 * n * chunks and text.count("prmt.b32") == 8 * n * chunks
    # W: the first set before the loop and both sets in it; x: two 16-byte loads an input a chunk used
    assert text.count("ld.global.nc.v4.b32") == 3 * chunks // 2 + 2 * n * chunks
    done = subprocess.run([find_tool("ptxas"), f"-arch=sm_{arch}", "-c", "-v", "-o", "/dev/null", "-"],
                          input=source.modules[0], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"[1-9]\d* bytes spill", done.stderr) is None, done.stderr


@pytest.mark.parametrize("arch", [90, 80])
def test_dense_writer_ptx_assembles_without_spills(arch):
    source = render_unpack24(arch)
    assert source.modules[0].count("st.global.v4.b32") == 2  # 32 bytes a chunk, every element written
    done = subprocess.run([find_tool("ptxas"), f"-arch=sm_{arch}", "-c", "-v", "-o", "/dev/null", "-"],
                          input=source.modules[0], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"[1-9]\d* bytes spill", done.stderr) is None, done.stderr


def test_gemv_refuses_what_it_cannot_serve():
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        render_gemv24("float32", 1, False)
    with pytest.raises(ValueError, match="1..16 inputs"):
        render_gemv24("float16", 17, False)
    with pytest.raises(ValueError, match="1..16 inputs"):
        render_gemv24("float16", 0, False)
    for unroll in (0, 5, 2.0):
        with pytest.raises(ValueError, match="chunks a register set"):
            render_gemv24("float16", 1, False, unroll=unroll)
    with pytest.raises(Sparse24Error, match="unroll is the chunks a register set"):
        Gemv24(weight_24(16, 16, torch.float16), unroll=0)
    with pytest.raises(Sparse24Error, match="CUDA device"):
        Gemv24(weight_24(16, 16, torch.float16))


def test_densify_refuses_an_output_it_cannot_write_before_launching():
    """The dense writer's output checks (shape, dtype, device, contiguity, the 16-byte alignment its stores
    need) run before any CUDA call: checked here on a GEMV whose packed W lives on the CPU."""
    w = weight_24(32, 64, torch.float16)
    gemv = Gemv24.__new__(Gemv24)
    gemv.packed, gemv.dtype, gemv.device = pack_24(w), w.dtype, w.device
    with pytest.raises(Sparse24Error, match=r"32 x 64 torch.float16 .* got \(64, 32\)"):
        gemv.densify(torch.empty(64, 32, dtype=torch.float16))
    with pytest.raises(Sparse24Error, match="got \\(32, 64\\) torch.float32"):
        gemv.densify(torch.empty(32, 64))
    with pytest.raises(Sparse24Error, match="not contiguous"):
        gemv.densify(torch.empty(64, 32, dtype=torch.float16).t())
    with pytest.raises(Sparse24Error, match="misaligned"):
        gemv.densify(torch.empty(32 * 64 + 1, dtype=torch.float16)[1:].view(32, 64))
