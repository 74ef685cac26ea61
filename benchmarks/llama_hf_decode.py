"""Hugging Face Llama decode end to end: transformers' LlamaForCausalLM at the Llama-3-8B config (32 layers;
--layers cuts it) with seeded random weights (nothing downloaded), every decoder Linear pruned per row by
magnitude (--patterns: 50%, 70%, 2:4), converted with sparseforge.convert(model, tokens=batches), against the
same pruned model run dense by the same transformers code:

- conversion: seconds cold (an empty kernel cache: a temporary one unless SPARSEFORGE_CACHE_DIR is set) and
  warm (the same model again: what the caches hold is not measured again), peak GPU memory, the bytes of
  the decoder Linears (224 at 32 layers; lm_head apart) before and after, the shared prefill workspace
  counted;
- one decode step per token at each batch (--batches) and context (--contexts): a static KV cache filled to
  the context, the step captured in a CUDA graph on both sides (runtime.timing.graph_time_us); the decoder
  Linears alone timed the same way (their share of the dense step), and the dense step's bandwidth (every
  weight but the embedding, and the KV cache up to the context);
- generate of --generate new tokens at --generate-batches (greedy, one static cache reused by every call;
  transformers compiles the decode step with CUDA graphs on both sides): seconds, the decode part apart (the same generate of 1 token,
  the prompt's prefill, subtracted: prefill runs dense on the converted side, W written from the kernels' copies),
  the GPU's own time and kernels a decode token (CUPTI; the rest of the wall time a token is the GPU waiting
  on the host's loop), and whether the tokens equal the dense model's;
  --deferred-stop: with transformers' deferred stop check on the GPU too, so that the host never waits on a
  token's stop flag;
- correctness: each step's logits against the same pruned model's in float32 (a copy of it, run the same
  way): the converted model's error at most ERROR_FACTOR times the dense 16-bit model's own (float32 runs:
  against the dense model, within 2e-2).

JSON to benchmarks/results/ (or --out) with the provenance (GPU, date, commit, command), per-case records and
summary rows (model, sparsity, dtype, batch, layout, n, geomean_speedup_vs_cublas over the contexts,
conversion seconds, memory).

    PYTHONPATH=src python benchmarks/llama_hf_decode.py [--layers 32] [--patterns 0.5,0.7,2:4]
        [--dtype float16] [--batches 1 8] [--contexts 128 2048] [--generate 128] [--tune-budget 2] [--out F]
    PYTHONPATH=src python benchmarks/llama_hf_decode.py --tiny --out /tmp/tiny.json   # a CPU smoke run

--tiny: a 2-layer Llama of hidden size 256 on the CPU, policy 'sparse' (nothing can be timed there: the
CPU path), eager steps timed by the wall clock; it checks the script, not the kernels.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import copy
import datetime
import gc
import inspect
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5,
                 tie_word_embeddings=False)
TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, tie_word_embeddings=False)
RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 32; --tiny: 2)")
    parser.add_argument("--patterns", default="0.5,0.7,2:4", help="comma-separated sparsities and/or N:M")
    parser.add_argument("--dtype", default=None, choices=("float16", "bfloat16", "float32"),
                        help="default float16; --tiny: float32 (CPUs have no fast half-precision matmul)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--contexts", type=int, nargs="+", default=None, help="default 128 2048; --tiny: 8 32")
    parser.add_argument("--generate", type=int, default=None, help="new tokens (default 128; --tiny: 8; 0: skip)")
    parser.add_argument("--generate-batches", type=int, nargs="+", default=[1],
                        help="batches generate runs at (each compiles both models once: minutes at 8B)")
    parser.add_argument("--tune-budget", type=float, default=2.0)
    parser.add_argument("--no-warm", action="store_true", help="skip the second (warm-cache) conversion")
    parser.add_argument("--fuse-mlp", action="store_true",
                        help="convert with fuse_mlp=True: each MLP's gate and up in one gated kernel where they can")
    parser.add_argument("--memory-slack", type=float, default=0.0,
                        help="convert with memory_slack: the share of a layer's decode time it may give for fewer "
                             "bytes of W (e.g. 0.07)")
    parser.add_argument("--deferred-stop", action="store_true",
                        help="generate with transformers' DeferredStopCheck on every device (it reads the stop flag "
                             "a step late, so the host never waits on the GPU a token; transformers enables it on "
                             "MPS only); needs a transformers that has it")
    parser.add_argument("--tiny", action="store_true", help="a small Llama on the CPU: checks the script")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.tiny else "float16")
    args.layers = args.layers or (TINY if args.tiny else LLAMA3_8B)["num_hidden_layers"]
    args.contexts = args.contexts or ([8, 32] if args.tiny else [128, 2048])
    args.generate = (8 if args.tiny else 128) if args.generate is None else args.generate
    args.patterns = [p.strip() for p in args.patterns.split(",") if p.strip()]
    for pattern in args.patterns:
        if ":" not in pattern and not 0 < float(pattern) < 1:
            parser.error(f"--patterns: {pattern} is neither a sparsity in (0, 1) nor N:M such as 2:4")
    if args.layers < 1 or min(args.batches) < 1 or min(args.contexts) < 1 or args.generate < 0:
        parser.error("--layers, --batches and --contexts must be positive, --generate >= 0")
    if not args.tiny and not torch.cuda.is_available():
        parser.error("the full benchmark needs a CUDA GPU; --tiny runs a small model on the CPU")
    if args.deferred_stop and args.tiny:
        parser.error("--deferred-stop runs on a GPU (transformers' deferred check records device events, which "
                     "the CPU lacks); drop --tiny or --deferred-stop")
    return args


def build(args, device) -> torch.nn.Module:
    """The seeded random model (the same weights every call), in args.dtype on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = {**(TINY if args.tiny else LLAMA3_8B), "num_hidden_layers": args.layers,
             "max_position_embeddings": max(args.contexts) + max(args.generate, 1) + 16}
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, args.dtype))  # built in its dtype: an 8B model in fp32 first is 32 GB
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**sizes))
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def prune(model, pattern: str) -> None:
    from sparseforge.prune import prune_model

    how = {"nm": pattern} if ":" in pattern else {"sparsity": float(pattern), "scope": "row"}
    prune_model(model, include=r"^model\.layers\.", keep_masks=False, **how)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


NOTES: list[str] = []  # what did not go as designed (a step that would not capture), into the JSON
STARTED = time.perf_counter()


def phase(what: str) -> None:
    """One flushed line a phase, seconds since the start: a run cut by a time limit still shows where the
    time went (the JSON is written after each pattern)."""
    print(f"[{time.perf_counter() - STARTED:7.1f} s] {what}", file=sys.stderr, flush=True)


def step_us(fn, device, what: str = "") -> float:
    """Microseconds per call of fn(): CUDA-graph replay on a GPU (eagerly, noted, where capture fails), the
    eager wall clock's median on a CPU."""
    if device.type == "cuda":
        from sparseforge.runtime.timing import TimingContention, eager_time_us, graph_time_us

        try:
            return graph_time_us(lambda _: fn(), [None], calls_per_graph=5, repeats=10)
        except TimingContention:
            raise
        except Exception as err:  # noted in the JSON: an eager time is not comparable to a graph-replayed one
            torch.cuda.synchronize(device)
            NOTES.append(f"{what}: CUDA graph capture failed ({type(err).__name__}: {str(err)[:200]}); timed eagerly")
            return eager_time_us(lambda _: fn(), [None] * 3, repeats=10)
    fn()
    times = []
    for _ in range(5):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def cache_argument(model) -> str:
    """The keyword a KV cache object goes by: transformers >= 5.2x names it `cache` (past_key_values
    deprecated); 5.17 knows only the old name."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def decode_step(model, batch: int, context: int, device):
    """(a no-argument decode step at position `context` over a static KV cache filled to it, its logits now)."""
    from transformers import StaticCache

    generator = torch.Generator().manual_seed(batch * 7919 + context)
    prompt = torch.randint(0, model.config.vocab_size, (batch, context), generator=generator).to(device)
    cache = StaticCache(config=model.config, max_cache_len=context + 8)
    with torch.no_grad():
        model(prompt, **{cache_argument(model): cache}, cache_position=torch.arange(context, device=device),
              use_cache=True)
    token = torch.randint(0, model.config.vocab_size, (batch, 1), generator=generator).to(device)
    position = torch.tensor([context], device=device)
    positions = position.expand(batch, 1)

    # A static cache layer writes where its own token count (cumulative_length, advanced in place by every
    # update) points, not at cache_position: set it back so that every call and graph replay writes at
    # `context`, the step timed the same each time and never past the cache's end.
    counters = [layer.cumulative_length for layer in getattr(cache, "layers", ())
                if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]

    def step():
        for counter in counters:
            counter.fill_(context)
        with torch.no_grad():
            return model(token, **{cache_argument(model): cache}, cache_position=position, position_ids=positions,
                         use_cache=True).logits

    return step, step().float()


ERROR_FACTOR = 1.5  # the converted model's logits may be this much further from float32 than the dense model's


def reference_logits(model, args, device) -> dict:
    """(batch, context) -> the decode step's logits of a float32 copy of `model` (None for a float32 model: the
    dense side is then the reference). The copy is freed before the conversion."""
    if next(model.parameters()).dtype == torch.float32:
        return {}
    reference = copy.deepcopy(model).float()
    logits = {(b, c): decode_step(reference, b, c, device)[1] for b in args.batches for c in args.contexts}
    del reference
    gc.collect()  # the 32 GB copy (8B in float32) gone before the conversion measures its peak
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return logits


def _relative(got, want) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def linears_us(model, names: list[str], batch: int, device) -> float:
    """The decoder Linears alone, each on a (batch, 1, in_features) input, one after another."""
    dtype = next(model.parameters()).dtype
    calls = [(model.get_submodule(n), torch.randn(batch, 1, model.get_submodule(n).in_features, device=device,
                                                  dtype=dtype)) for n in names]

    def run():
        with torch.no_grad():
            for module, x in calls:
                module(x)

    return step_us(run, device, f"decoder Linears b{batch}")


@contextlib.contextmanager
def stop_check_deferred(enabled: bool):
    """Within it, transformers' generate defers its stop check (DeferredStopCheck: the flag copied without a
    sync and read a step later, one extra step undone) on any device, where its own rules (the cache can be
    cropped back) allow it as on MPS. Without that, each token's `unfinished_sequences.max() == 0` blocks the
    host until the GPU has finished the step, and the GPU then idles through the host's loop."""
    if not enabled:
        yield
        return
    import transformers
    from transformers.generation import utils

    checker = getattr(utils, "DeferredStopCheck", None)
    if checker is None or not isinstance(inspect.getattr_static(checker, "is_supported", None), staticmethod):
        raise SystemExit(f"--deferred-stop needs transformers' DeferredStopCheck (5.25 has it); transformers "
                         f"{transformers.__version__} has none: upgrade it, or run without --deferred-stop")
    original = inspect.getattr_static(checker, "is_supported")

    def is_supported(device, *args, **kwargs):  # transformers' rules, with the device check passed as MPS
        return original.__func__(torch.device("mps"), *args, **kwargs)

    checker.is_supported = staticmethod(is_supported)
    try:
        yield
    finally:
        checker.is_supported = original


def generate(model, batch: int, args, device) -> dict:
    """A greedy generate of args.generate tokens after one warm-up call: its seconds, those of the prefill
    (the same generate of 1 token), and the tokens.

    Every call gets the same StaticCache, reset: with cache_implementation="static" each generate makes a new
    cache, and where the allocator places it elsewhere than the one the compiled step was recorded with, CUDA
    graph trees take the re-record path at every token (seen on the H200: 7.4 instead of 5.2 ms a token on
    whichever side it hit), so the figure measured the allocator, not the model."""
    from transformers import StaticCache

    generator = torch.Generator().manual_seed(batch)
    prompt = torch.randint(0, model.config.vocab_size, (batch, min(args.contexts)), generator=generator).to(device)
    # a deferred stop check runs one step more before undoing it: a slot beyond the tokens for it
    cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + args.generate + args.deferred_stop)
    options = {"do_sample": False, "attention_mask": torch.ones_like(prompt), "pad_token_id": 0,
               cache_argument(model): cache}

    def timed(new: int):
        cache.reset()
        sync(device)
        started = time.perf_counter()
        with stop_check_deferred(args.deferred_stop):
            tokens = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, **options)
        sync(device)
        return time.perf_counter() - started, tokens

    with torch.no_grad():
        timed(args.generate)  # compiles the decode step (CUDA), fills caches
        seconds, tokens = timed(args.generate)
        prefill = min(timed(1)[0] for _ in range(3))
    result = {"seconds": seconds, "prefill_seconds": prefill, "tokens": tokens}
    if device.type == "cuda" and args.generate > 1:
        # the GPU's own time a decode token (kernel durations read by CUPTI, the prefill's subtracted): against
        # the wall seconds a token, what the GPU sat idle for, waiting on the host's generate loop
        from sparseforge.bench.profile import kernel_breakdown

        try:
            busy = {new: kernel_breakdown(lambda new=new: timed(new), calls=1) for new in (args.generate, 1)}
        except RuntimeError as exc:  # the profiler needs CUPTI: the figure is extra, the run goes on
            NOTES.append(f"generate's GPU time not read ({type(exc).__name__}: {str(exc)[:200]})")
        else:
            tokens_after = args.generate - 1
            result.update(gpu_s_per_token=(busy[args.generate]["busy_us_per_call"] - busy[1]["busy_us_per_call"])
                          / tokens_after / 1e6,
                          kernels_per_token=(busy[args.generate]["kernels_per_call"] - busy[1]["kernels_per_call"])
                          / tokens_after)
    per_token = (seconds - prefill) / max(args.generate - 1, 1)
    gpu = result.get("gpu_s_per_token")
    phase(f"generate b{batch}: {seconds:.3f} s, prefill {prefill:.3f} s, {per_token * 1e3:.2f} ms a decode token"
          + ("" if gpu is None else f" ({gpu * 1e3:.2f} ms of it on the GPU, {result['kernels_per_token']:.0f} "
                                    "kernels)"))
    return result


def measure_side(model, args, device, names) -> dict:
    """Per (batch, context) the step time and logits; per batch the Linears' time and the generate run."""
    out = {"steps": {}, "linears_us": {}, "generate": {}}
    for batch in args.batches:
        out["linears_us"][batch] = linears_us(model, names, batch, device)
        for context in args.contexts:
            step, logits = decode_step(model, batch, context, device)
            out["steps"][(batch, context)] = (step_us(step, device, f"decode step b{batch} c{context}"), logits)
        if args.generate and batch in args.generate_batches:
            out["generate"][batch] = generate(model, batch, args, device)
        torch._dynamo.reset()  # each side compiles its own decode step
    return out


def geomean(values) -> float:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def two_four_paths(model) -> dict:
    """How many 2:4 layers run each (eager path, graph path) at each width, e.g. {"1: 2:4-gemv / 2:4-gemv": 224}:
    whether every layer of a shape runs what its first layer measured."""
    from collections import Counter

    from sparseforge.nn import DecodeLinear, SparseLinear24

    counts = Counter(f"{n}: {eager} / {graph}" for module in model.modules()
                     if isinstance(module, DecodeLinear) and isinstance(module.inner, SparseLinear24)
                     for n, (eager, graph) in sorted(module.inner.chosen_paths().items()))
    return dict(sorted(counts.items()))


def run_pattern(pattern: str, args, device) -> tuple[list[dict], dict]:
    import sparseforge
    from sparseforge.nn.llm import decoder_linear_names, linear_bytes

    model = build(args, device)
    phase(f"{pattern}: model built")
    prune(model, pattern)
    phase(f"{pattern}: pruned")
    # the same weights for the warm conversion, kept in host memory (the cold conversion's peak is its own)
    spare = None if args.no_warm else copy.deepcopy(model).to("cpu")
    names = decoder_linear_names(model)
    # what one decode step reads: every weight but the embedding (a row per token), and the KV cache
    embedding = model.get_input_embeddings().weight
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - \
        embedding.numel() * embedding.element_size()
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * embedding.element_size()
    bytes_before = linear_bytes(model, names)
    dense = measure_side(model, args, device, names)
    phase(f"{pattern}: dense side measured")
    reference = reference_logits(model, args, device)
    policy = "measure" if device.type == "cuda" else "sparse"
    report = sparseforge.convert(model, tokens=tuple(args.batches), policy=policy, tune_budget=args.tune_budget,
                                 fuse_mlp=args.fuse_mlp, memory_slack=args.memory_slack)
    conversion = {"cold_seconds": report.seconds, "peak_gpu_bytes": report.peak_gpu_bytes,
                  "measured_shapes": report.measured, "reused_shapes": report.reused, "replaced": len(report.replaced),
                  "fused_mlps": len(report.fused_mlps),
                  "choices": {c: sum(layer.choice == c for layer in report.layers)
                              for c in {layer.choice for layer in report.layers}}}
    conversion["two_four_paths"] = two_four_paths(model)
    phase(f"{pattern}: converted in {report.seconds:.1f} s ({report.measured} shapes measured, choices "
          f"{conversion['choices']})")
    bytes_after = linear_bytes(model, names)
    converted = measure_side(model, args, device, names)
    phase(f"{pattern}: converted side measured")
    if spare is not None:
        spare.to(device)
        profiler = cProfile.Profile()  # where a warm conversion's seconds go: the top functions land in the JSON
        profiler.enable()
        warm = sparseforge.convert(spare, tokens=tuple(args.batches), policy=policy, tune_budget=args.tune_budget,
                                   progress=False, fuse_mlp=args.fuse_mlp, memory_slack=args.memory_slack)
        profiler.disable()
        from sparseforge.bench.report import top_functions

        conversion.update(warm_seconds=warm.seconds, warm_measured_shapes=warm.measured,
                          warm_reused_shapes=warm.reused, warm_profile=top_functions(profiler))
        phase(f"{pattern}: converted again (warm cache) in {warm.seconds:.1f} s ({warm.measured} shapes measured, "
              f"{warm.reused} decided by the first conversion)")
        del spare
    sparsity = pattern if ":" in pattern else float(pattern)
    model_name = f"llama3-8b-hf-{args.layers}L" if not args.tiny else f"llama-tiny-hf-{args.layers}L"
    cases, summary = [], []
    for batch in args.batches:
        rows = []
        for context in args.contexts:
            dense_us, want = dense["steps"][(batch, context)]
            sparse_us, got = converted["steps"][(batch, context)]
            error = _relative(got, want)
            if reference:  # the converted model against float32, beside the dense 16-bit model's own error
                exact = reference[(batch, context)]
                checks = {"rel_error_vs_float32": _relative(got, exact),
                          "dense_rel_error_vs_float32": _relative(want, exact)}
                checks["error_ok"] = checks["rel_error_vs_float32"] <= ERROR_FACTOR * checks["dense_rel_error_vs_float32"]
            else:
                checks = {"error_ok": error <= 2e-2}
            rows.append({"model": model_name, "sparsity": sparsity, "dtype": args.dtype, "batch": batch,
                         "layout": "nk", "n": batch, "context": context, "dense_us": dense_us,
                         "sparseforge_us": sparse_us, "speedup_vs_cublas": dense_us / sparse_us,
                         "dense_step_bytes": weight_bytes + kv_bytes_per_token * batch * context,
                         "dense_tbps": (weight_bytes + kv_bytes_per_token * batch * context) / dense_us / 1e6,
                         "dense_linears_us": dense["linears_us"][batch],
                         "sparseforge_linears_us": converted["linears_us"][batch],
                         "dense_non_linear_share": 1 - dense["linears_us"][batch] / dense_us,
                         "rel_error_vs_dense": error, **checks})
        if batch in dense["generate"]:
            before, after = dense["generate"][batch], converted["generate"][batch]
            decode = [(side["seconds"] - side["prefill_seconds"]) / max(args.generate - 1, 1)
                      for side in (before, after)]
            for row in rows:
                row.update(generate_tokens=args.generate, dense_generate_s=before["seconds"],
                           sparseforge_generate_s=after["seconds"],
                           generate_speedup=before["seconds"] / after["seconds"],
                           dense_prefill_s=before["prefill_seconds"], sparseforge_prefill_s=after["prefill_seconds"],
                           dense_generate_s_per_token=decode[0], sparseforge_generate_s_per_token=decode[1],
                           generate_decode_speedup=decode[0] / decode[1] if decode[1] > 0 else None,
                           dense_generate_gpu_s_per_token=before.get("gpu_s_per_token"),
                           sparseforge_generate_gpu_s_per_token=after.get("gpu_s_per_token"),
                           dense_generate_kernels_per_token=before.get("kernels_per_token"),
                           sparseforge_generate_kernels_per_token=after.get("kernels_per_token"),
                           generate_tokens_equal=float((before["tokens"] == after["tokens"]).float().mean()))
        cases += rows
        summary.append({"model": model_name, "sparsity": sparsity, "dtype": args.dtype, "batch": batch,
                        "layout": "nk", "n": batch, "contexts": list(args.contexts), "cases": len(rows),
                        "geomean_speedup_vs_cublas": geomean(r["speedup_vs_cublas"] for r in rows),
                        "all_correct": all(r["error_ok"] for r in rows),
                        "conversion_seconds_cold": conversion["cold_seconds"],
                        "conversion_seconds_warm": conversion.get("warm_seconds"),
                        "peak_gpu_bytes": conversion["peak_gpu_bytes"],
                        "decoder_linear_bytes_before": bytes_before, "decoder_linear_bytes_after": bytes_after,
                        "decoder_linear_memory_ratio": bytes_before / bytes_after,
                        "generate_speedup": rows[0].get("generate_speedup"),
                        "generate_decode_speedup": rows[0].get("generate_decode_speedup")})
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return cases, {"pattern": pattern, "summary": summary, "conversion": conversion, "report": report.as_dict()}


def main(argv=None) -> int:
    import json

    from sparseforge.bench.report import provenance

    args = parse_args(argv)
    device = torch.device("cpu" if args.tiny else "cuda")
    if device.type == "cuda" and "SPARSEFORGE_CACHE_DIR" not in os.environ:
        os.environ["SPARSEFORGE_CACHE_DIR"] = tempfile.mkdtemp(prefix="sparseforge-cold-")  # cold: an empty cache
    info = provenance(sys.argv if argv is None else ["benchmarks/llama_hf_decode.py", *argv])
    gpu = (info.get("gpu") or "cpu").split()[-1].lower()
    out = args.out or RESULTS / f"{gpu}_{datetime.date.today()}_llama_hf_decode_{args.dtype}_{args.layers}L.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    arguments = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    payload = {"provenance": info, "arguments": arguments, "summary": [], "patterns": [], "cases": [],
               "notes": NOTES}
    status = 0
    for pattern in args.patterns:
        cases, result = run_pattern(pattern, args, device)
        payload["cases"] += cases
        payload["summary"] += result.pop("summary")
        payload["patterns"].append(result)
        out.write_text(json.dumps(payload, indent=1, default=str))  # after every pattern: partial runs land
        for row in payload["summary"][-len(args.batches):]:
            status |= not row["all_correct"]
            print(f"{row['model']} {pattern} {args.dtype} batch {row['batch']}: decode step "
                  f"{row['geomean_speedup_vs_cublas']:.2f}x (geomean over contexts {args.contexts}); conversion "
                  f"{row['conversion_seconds_cold']:.1f} s cold, {row['conversion_seconds_warm'] or float('nan'):.1f} "
                  f"s warm; decoder Linears {row['decoder_linear_memory_ratio']:.2f}x smaller"
                  + ("" if row["all_correct"] else "; LOGITS OFF"))
    print(f"wrote {out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
