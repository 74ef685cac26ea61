"""Convolution cases with their real geometry, named by a spec `sparseforge bench` takes:

- `conv:PATH`: the 3x3 and 7x7 layers of a DLMC ResNet-50 directory (e.g. .../rn50/magnitude_pruning/0.9):
  the `bottleneck_2_*` 3x3 convolutions (padding 1; stride 2 in the projection blocks of groups 2-4) and
  the 7x7 / 2 initial convolution at 224 x 224, their output sizes from rn50_batchsizes.txt; patterns from
  the .smtx files (Cout x kh*kw*Cin in TensorFlow's order, reordered to torch's), values from a seeded
  normal;
- `conv:vgg16[:sparsities]`: VGG-16's 13 3x3 convolutions at 224 x 224, magnitude-pruned from seeded
  normal weights (default 0.8, 0.9, 0.95);
- `conv:textcnn[:sparsities]`: CNN-non-static's 1-D convolutions (300-dim embeddings, 64 words, 100 maps
  of widths 3, 4 and 5) as 1 x w Conv2d over 1 x 64 images, pruned alike.
`--batch` sets every case's batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..formats import SparseMatrix, read_smtx
from ..plan.conv import ConvGeometry
from .cases import BATCHSIZES_FILE, find_batchsizes, parse_sparsity
from .llm import magnitude_prune

CONV_PREFIX = "conv"
CONV_SPARSITIES = (0.8, 0.9, 0.95)
# VGG-16's convolutions: (input channels, output channels, input size), 3x3, padding 1, stride 1
VGG16 = ((3, 64, 224), (64, 64, 224), (64, 128, 112), (128, 128, 112), (128, 256, 56), (256, 256, 56),
         (256, 256, 56), (256, 512, 28), (512, 512, 28), (512, 512, 28), (512, 512, 14), (512, 512, 14),
         (512, 512, 14))
TEXT_CNN = {"embedding": 300, "words": 64, "maps": 100, "widths": (3, 4, 5)}


@dataclass(frozen=True)
class ConvCase:
    """One convolution layer: its name, model, sparsity, geometry (batch included) and where W comes from
    (a .smtx pattern, or a seeded normal weight magnitude-pruned)."""
    name: str
    model: str
    sparsity: float
    layer: str
    geometry: ConvGeometry
    smtx: Path | None = None
    seed: int = 0

    @property
    def nnz_estimate(self) -> int:
        rows, cols = self.geometry.weight_shape
        return int(round(rows * cols * (1 - self.sparsity)))

    def load(self, seed: int = 0, dtype="float32") -> SparseMatrix:
        """W as Cout x Cin/groups*kh*kw in torch's (ci, r, s) order. DLMC's .smtx files hold TensorFlow's
        (r, s, ci) order (HWIO flattened: per tap, the nonzeros peak at the kernel's centre only when read
        that way), so their columns are reordered; the values are drawn for the file's order first."""
        if self.smtx is not None:
            return tf_to_torch_order(SparseMatrix.from_smtx(self.smtx, seed=seed, dtype=dtype), self.geometry)
        rows, cols = self.geometry.weight_shape
        rng = np.random.default_rng(self.seed + seed)
        return magnitude_prune(rng.standard_normal((rows, cols)).astype(np.float32), self.sparsity, dtype)


def tf_to_torch_order(w: SparseMatrix, geometry: ConvGeometry) -> SparseMatrix:
    """Columns (r*kw + s)*Cin + ci -> ci*kh*kw + r*kw + s (Cin per group), each row sorted again."""
    cin, taps = geometry.channels // geometry.groups, geometry.taps
    cols = w.indices.astype(np.int64)
    reordered = (cols % cin) * taps + cols // cin
    rows = np.repeat(np.arange(w.shape[0]), w.row_nnz)
    order = np.lexsort((reordered, rows))
    return SparseMatrix(w.indptr, reordered[order], w.values[order], w.shape, w.dtype)


def is_conv_spec(spec) -> bool:
    return isinstance(spec, str) and spec.startswith(CONV_PREFIX + ":")


def _sparsities(text: str, spec: str) -> list[float]:
    if not text:
        return list(CONV_SPARSITIES)
    out = []
    for item in text.split(","):
        try:
            value = float(item)
        except ValueError:
            value = -1.0
        if not 0.0 <= value < 1.0:
            raise ValueError(f"conv suite spec {spec!r}: sparsity {item!r} is not a number in [0, 1); give e.g. "
                             "conv:vgg16:0.8,0.9")
        out.append(value)
    return out


def vgg16_cases(sparsities=CONV_SPARSITIES, batch: int = 1) -> list[ConvCase]:
    cases = []
    for sparsity in sparsities:
        for i, (cin, cout, size) in enumerate(VGG16):
            geometry = ConvGeometry.of((batch, cin, size, size), cout, 3, 1, 1)
            cases.append(ConvCase(f"conv/vgg16/conv{i + 1}@{sparsity:g}", "vgg16", sparsity, f"conv{i + 1}", geometry,
                                  seed=100 + i))
    return cases


def textcnn_cases(sparsities=CONV_SPARSITIES, batch: int = 1) -> list[ConvCase]:
    t = TEXT_CNN
    return [ConvCase(f"conv/textcnn/width{w}@{sparsity:g}", "textcnn", sparsity, f"width{w}",
                     ConvGeometry.of((batch, t["embedding"], 1, t["words"]), t["maps"], (1, w)), seed=200 + w)
            for sparsity in sparsities for w in t["widths"]]


def rn50_cases(directory: Path, batch: int = 1) -> list[ConvCase]:
    """The 3x3 (bottleneck_2_*) and 7x7 (initial_conv) layers of a DLMC rn50 directory."""
    directory = Path(directory)
    sizes = find_batchsizes(directory)  # rn50_batchsizes.txt above it (or the bundled sample's)
    sparsity = parse_sparsity(directory.name)
    if sparsity is None:  # a name such as 1.5 is no sparsity either
        raise ValueError(f"{directory}: expected a DLMC rn50 sparsity directory such as .../rn50/magnitude_pruning/0.9 "
                         "(its name the sparsity, a number in [0, 1))")
    cases = []
    for path in sorted(directory.glob("*.smtx")):
        layer = path.stem
        if not (layer.startswith("bottleneck_2_") or layer == "initial_conv") or layer not in sizes:
            continue
        (m, k), _, _ = read_smtx(path)  # the whole file checked now, not when its case runs
        taps = 49 if layer == "initial_conv" else 9
        if k % taps:  # K // taps channels would give a weight of another width: an unrelated error much later
            raise ValueError(f"{path}: K = {k} is not a multiple of the {int(math.sqrt(taps))}x{int(math.sqrt(taps))} "
                             f"taps ({taps}) a {layer} layer has; this is not a DLMC rn50 pattern for that layer")
        out = math.isqrt(sizes[layer])
        if out * out != sizes[layer]:  # a rounded side would be another layer's geometry, silently
            raise ValueError(f"{layer}: {sizes[layer]} output pixels in {BATCHSIZES_FILE} is not a square image "
                             "(side x side); ResNet-50's are 112^2, 56^2, 28^2, 14^2 and 7^2")
        if layer == "initial_conv":
            geometry = ConvGeometry.of((batch, k // 49, 2 * out, 2 * out), m, 7, 2, 3)
        else:
            stride = 2 if "projection_block_group" in layer and not layer.endswith("group1") else 1
            geometry = ConvGeometry.of((batch, k // 9, out * stride, out * stride), m, 3, stride, 1)
        cases.append(ConvCase(f"conv/rn50/{layer}@{sparsity:g}", "rn50", sparsity, layer, geometry, smtx=path))
    if not cases:
        raise ValueError(f"{directory}: no 3x3 (bottleneck_2_*) or 7x7 (initial_conv) layers with a known size")
    return cases


def discover_conv(spec: str, batch: int = 1) -> list[ConvCase]:
    """The cases a `conv:...` spec names (module docstring)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    rest = spec[len(CONV_PREFIX) + 1:]
    if not rest:  # Path("") is ".", which would be read as a DLMC directory
        raise ValueError(f"conv suite spec {spec!r} names no cases: give conv:vgg16[:sparsities], "
                         "conv:textcnn[:sparsities] or conv:DIR with DIR a DLMC rn50 sparsity directory")
    name, _, sparsities = rest.partition(":")
    if name == "vgg16":
        return vgg16_cases(_sparsities(sparsities, spec), batch)
    if name == "textcnn":
        return textcnn_cases(_sparsities(sparsities, spec), batch)
    path = Path(rest)
    if path.is_dir():
        return rn50_cases(path, batch)
    raise ValueError(f"conv suite spec {spec!r}: give conv:vgg16[:sparsities], conv:textcnn[:sparsities] or "
                     "conv:DIR with DIR a DLMC rn50 sparsity directory")


def with_batch(case: ConvCase, batch: int) -> ConvCase:
    return replace(case, geometry=replace(case.geometry, batch=batch))
