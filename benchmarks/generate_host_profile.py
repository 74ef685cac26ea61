"""Where the host's time goes in transformers' `generate` on a converted model against the same model dense:
the Llama-3-8B widths with fewer layers (seeded weights, pruned per row by magnitude), converted at batch 1,
then for each side one warm-up generate and one profiled generate of the same tokens (the reused static cache,
as llama_hf_decode.py runs it): its seconds a token, the top Python functions by their own time (cProfile) and
the calls into sparseforge a token. A converted step that is one CUDA-graph replay runs no sparseforge Python
a token; where some runs, that is the host time the GPU waits for.

    PYTHONPATH=src python benchmarks/generate_host_profile.py OUT.json [--layers 8] [--sparsity 0.7]
        [--tokens 64]
"""
import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_hf_decode as hf  # noqa: E402  (the benchmark's model, pruning and cache handling)

from sparseforge.bench.report import provenance  # noqa: E402


def _profiled_generate(model, args, device) -> dict:
    from transformers import StaticCache

    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (1, 128), generator=generator).to(device)
    cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + 2 * args.tokens)
    options = {"do_sample": False, "attention_mask": torch.ones_like(prompt), "pad_token_id": 0,
               hf.cache_argument(model): cache}

    from transformers import StoppingCriteria, StoppingCriteriaList

    stamps: list[float] = []

    class Stamp(StoppingCriteria):
        """The host's clock at each token's stopping check (generate reads the tokens there, a sync a token)."""

        def __call__(self, input_ids, scores, **kwargs):
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def run(new: int) -> float:
        cache.reset()
        stamps.clear()
        torch.cuda.synchronize()
        started = time.perf_counter()
        model.generate(prompt, max_new_tokens=new, min_new_tokens=new, stopping_criteria=StoppingCriteriaList([Stamp()]),
                       **options)
        torch.cuda.synchronize()
        return time.perf_counter() - started

    from torch._dynamo.utils import counters

    counters.clear()
    with torch.no_grad():
        run(args.tokens)  # compiles the decode step, records its graph
        run(args.tokens)
        seconds = run(args.tokens)
        gaps = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]  # ms between tokens' stopping checks
        twice = run(2 * args.tokens)
        one = min(run(1) for _ in range(3))
        profiler = cProfile.Profile()
        profiler.enable()
        run(args.tokens)
        profiler.disable()
    stats = pstats.Stats(profiler)
    rows = sorted(((key, value) for key, value in stats.stats.items()), key=lambda kv: -kv[1][2])
    top = [{"function": f"{key[0]}:{key[1]}({key[2]})", "calls": value[1], "own_s": value[2], "total_s": value[3]}
           for key, value in rows[:40]]
    ours = [{"function": f"{key[0]}:{key[1]}({key[2]})", "calls": value[1], "own_s": value[2]}
            for key, value in rows if "sparseforge" in key[0]]
    per_token = (seconds - one) / (args.tokens - 1)
    # whether the compiled step ran as CUDA graphs at all, and in how many pieces
    compiled = {group: dict(values) for group, values in counters.items()
                if group in ("stats", "inductor", "graph_break", "recompiles", "unimplemented")}
    with torch.no_grad():
        cache.reset()
        model(prompt, **{hf.cache_argument(model): cache}, cache_position=torch.arange(prompt.shape[1], device=device),
              use_cache=True)
        token = prompt[:, -1:]
        position = torch.tensor([prompt.shape[1]], device=device)
        explained = torch._dynamo.explain(model)(token, **{hf.cache_argument(model): cache}, cache_position=position,
                                                 position_ids=position.expand(1, 1), use_cache=True)
    return {"graphs": explained.graph_count, "graph_breaks": explained.graph_break_count,
            "break_reasons": [str(b.reason)[:300] for b in explained.break_reasons[:20]],
            "graph_inputs": [len(list(g.graph.find_nodes(op="placeholder"))) for g in explained.graphs],
            "counters": compiled,
            "seconds": seconds, "prefill_seconds": one, "ms_per_decode_token": per_token * 1e3,
            "ms_per_token_marginal": (twice - seconds) / args.tokens * 1e3,
            "token_gaps_ms": {"first": gaps[:4], "median": sorted(gaps)[len(gaps) // 2] if gaps else None,
                              "max": max(gaps, default=None)},
            "top_own_time": top, "sparseforge_calls_per_token": sum(r["calls"] for r in ours) / args.tokens,
            "sparseforge_functions": ours[:40]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--sparsity", default="0.7")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: this profile runs transformers' generate on a CUDA GPU", file=sys.stderr)
        return 2
    import sparseforge

    device = torch.device("cuda")
    build_args = argparse.Namespace(tiny=False, layers=args.layers, contexts=[128], generate=args.tokens,
                                    dtype="float16")
    model = hf.build(build_args, device)
    hf.prune(model, args.sparsity)
    result = {"provenance": provenance(sys.argv if argv is None else ["benchmarks/generate_host_profile.py", *argv]),
              "layers": args.layers, "sparsity": args.sparsity, "tokens": args.tokens}
    result["dense"] = _profiled_generate(model, args, device)
    hf.phase(f"dense: {result['dense']['ms_per_decode_token']:.2f} ms a token, marginal "
             f"{result['dense']['ms_per_token_marginal']:.2f}, gaps {result['dense']['token_gaps_ms']}")
    torch._dynamo.reset()
    sparseforge.convert(model, tokens=(1,), policy="measure", tune_budget=1.0, progress=False)
    hf.phase("converted")
    result["converted"] = _profiled_generate(model, args, device)
    hf.phase(f"converted: {result['converted']['ms_per_decode_token']:.2f} ms a token, marginal "
             f"{result['converted']['ms_per_token_marginal']:.2f}, gaps {result['converted']['token_gaps_ms']}, "
             f"{result['converted']['sparseforge_calls_per_token']:.0f} sparseforge calls a token")
    dense, converted = result["dense"], result["converted"]
    result["summary"] = [{"model": f"llama3-8b-hf-{args.layers}L", "sparsity": float(args.sparsity),
                          "dtype": "float16", "batch": 1, "layout": "nk", "n": 1,
                          # a decode token of generate, dense over converted (host time and all)
                          "geomean_speedup_vs_cublas": dense["ms_per_decode_token"] / converted["ms_per_decode_token"],
                          "generate_decode_speedup_marginal": dense["ms_per_token_marginal"]
                          / converted["ms_per_token_marginal"]}]
    for side in ("dense", "converted"):
        r = result[side]
        print(f"== {side}: {r['graphs']} graphs, {r['graph_breaks']} breaks, inputs {r['graph_inputs']}; "
              f"counters {json.dumps(r['counters'], default=str)[:1500]}")
        for reason in r["break_reasons"][:8]:
            print(f"  break: {reason}")
        print(f"== {side}: top own time")
        for row in result[side]["top_own_time"][:20]:
            print(f"  {row['own_s'] * 1e3:9.2f} ms {row['calls']:7d}  {row['function']}")
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
