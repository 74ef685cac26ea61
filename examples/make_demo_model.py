"""The demo's small CNN (`bash dev.sh demo`), in three steps around the sparseforge command line:

    python examples/make_demo_model.py weights OUT.safetensors       a seeded state dict to prune
    python examples/make_demo_model.py model IN.safetensors OUT.pt    the network with IN's (pruned) weights, saved
                                                                      whole with torch.save (what convert reads)
    python examples/make_demo_model.py check PRUNED.pt CONVERTED.pt   the converted model against the pruned one
                                                                      on random inputs, in float64 on the CPU
"""
import argparse
import sys

import torch
from torch import nn

SHAPE = (1, 3, 32, 32)  # the input the demo converts for (--example-shape)


def network() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.Conv2d(64, 64, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10),
    )


def calibrated(model: nn.Sequential) -> nn.Sequential:
    """BatchNorm statistics from a few random batches (a freshly initialised one folds to the identity)."""
    model.train()
    with torch.no_grad():
        for _ in range(4):
            model(torch.randn(16, *SHAPE[1:]))
    return model.eval()


def weights(out: str) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in calibrated(network()).state_dict().items()}, out)
    print(f"wrote {out}")


def model(state: str, out: str) -> None:
    from safetensors.torch import load_file

    net = network()
    net.load_state_dict(load_file(state))
    torch.save(net.eval(), out)
    zeros = sum(int((p == 0).sum()) for n, p in net.named_parameters() if n.endswith("weight") and p.dim() > 1)
    total = sum(p.numel() for n, p in net.named_parameters() if n.endswith("weight") and p.dim() > 1)
    print(f"wrote {out}: the network with {state}'s weights ({zeros / total:.1%} of its Conv2d / Linear weights zero)")


def check(pruned: str, converted: str) -> int:
    """Both models in float64 on the CPU (the converted one through its layers' CPU path: the sparse weights
    as sparseforge holds them, BatchNorm folded, epilogues fused) on 8 random inputs. The bound is float32's:
    convert folded the BatchNorms in the model's dtype."""
    import sparseforge  # noqa: F401  (the converted model's classes)

    a = torch.load(pruned, weights_only=False, map_location="cpu").double().eval()
    b = torch.load(converted, weights_only=False, map_location="cpu").double().eval()
    x = torch.randn(8, *SHAPE[1:], dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, out = a(x), b(x)
    error = float((out - ref).norm() / ref.norm())
    ok = error < 1e-6
    print(f"converted vs pruned model, float64, 8 inputs: relative error {error:.1e} ({'ok' if ok else 'FAIL'})")
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="step", required=True)
    sub.add_parser("weights").add_argument("out")
    p = sub.add_parser("model")
    p.add_argument("state")
    p.add_argument("out")
    p = sub.add_parser("check")
    p.add_argument("pruned")
    p.add_argument("converted")
    args = parser.parse_args()
    if args.step == "weights":
        weights(args.out)
    elif args.step == "model":
        model(args.state, args.out)
    else:
        sys.exit(check(args.pruned, args.converted))
