"""A BERT encoder (the layers of transformers' BertModel: embeddings, post-norm self-attention and GELU MLP
blocks) for the MiniLM latency figure: every projection an nn.Linear (query, key, value,
attention.output.dense, intermediate.dense, output.dense), so `convert` reaches them, and no transformers
import, so it runs where only torch is installed (the GPU image). Parameter names are BertModel's, so a
sentence-transformers checkpoint (all-MiniLM-L6-v2's model.safetensors) loads with load_bert_weights;
`bert_encoder(seed=...)` draws weights as BertModel initialises them (normal, std 0.02) where only speed is
measured. `MINILM_L6` holds all-MiniLM-L6-v2's widths.

forward(input_ids, attention_mask) -> last hidden state (batch, tokens, hidden); mean_pool gives the
sentence embedding all-MiniLM-L6-v2 uses (the mean of unpadded tokens' states).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class BertShape:
    hidden: int = 384
    intermediate: int = 1536
    heads: int = 12
    layers: int = 6
    vocab: int = 30522
    max_positions: int = 512
    type_vocab: int = 2
    eps: float = 1e-12

    def __post_init__(self):
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")


MINILM_L6 = BertShape()


class _Embeddings(nn.Module):
    def __init__(self, s: BertShape):
        super().__init__()
        self.word_embeddings = nn.Embedding(s.vocab, s.hidden, padding_idx=0)
        self.position_embeddings = nn.Embedding(s.max_positions, s.hidden)
        self.token_type_embeddings = nn.Embedding(s.type_vocab, s.hidden)
        self.LayerNorm = nn.LayerNorm(s.hidden, eps=s.eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        # token type 0 throughout: sentence embeddings use one segment
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x)


class _SelfAttention(nn.Module):
    def __init__(self, s: BertShape):
        super().__init__()
        self.heads = s.heads
        self.query, self.key, self.value = (nn.Linear(s.hidden, s.hidden) for _ in range(3))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = (p(x).view(b, t, self.heads, h // self.heads).transpose(1, 2) for p in (self.query, self.key, self.value))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return out.transpose(1, 2).reshape(b, t, h)


class _DenseNorm(nn.Module):
    """dense -> (+ residual) -> LayerNorm: BertSelfOutput / BertOutput."""

    def __init__(self, cin: int, s: BertShape):
        super().__init__()
        self.dense = nn.Linear(cin, s.hidden)
        self.LayerNorm = nn.LayerNorm(s.hidden, eps=s.eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _Attention(nn.Module):
    def __init__(self, s: BertShape):
        super().__init__()
        setattr(self, "self", _SelfAttention(s))  # BertModel's name for it
        self.output = _DenseNorm(s.hidden, s)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.output(getattr(self, "self")(x, bias), x)


class _Intermediate(nn.Module):
    def __init__(self, s: BertShape):
        super().__init__()
        self.dense = nn.Linear(s.hidden, s.intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))  # BERT's exact (erf) GELU


class _Layer(nn.Module):
    def __init__(self, s: BertShape):
        super().__init__()
        self.attention, self.intermediate, self.output = _Attention(s), _Intermediate(s), _DenseNorm(s.intermediate, s)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, bias)
        return self.output(self.intermediate(x), x)


class _Encoder(nn.Module):
    def __init__(self, s: BertShape):
        super().__init__()
        self.layer = nn.ModuleList(_Layer(s) for _ in range(s.layers))


class BertEncoder(nn.Module):
    def __init__(self, shape: BertShape = MINILM_L6):
        super().__init__()
        self.shape = shape
        self.embeddings, self.encoder = _Embeddings(shape), _Encoder(shape)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"input_ids must be (batch, tokens) integers, got {tuple(input_ids.shape)} {input_ids.dtype}")
        if input_ids.shape[1] > self.shape.max_positions:
            raise ValueError(f"{input_ids.shape[1]} tokens; this encoder takes at most {self.shape.max_positions}")
        x = self.embeddings(input_ids)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        # additive: 0 where a key may be attended to, the dtype's minimum where it is padding (as BertModel)
        bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        for layer in self.encoder.layer:
            x = layer(x, bias)
        return x


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The sentence embedding of all-MiniLM-L6-v2: the mean of the unpadded tokens' last hidden states."""
    mask = attention_mask[..., None].to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)


def bert_encoder(shape: BertShape = MINILM_L6, seed: int = 0) -> BertEncoder:
    """A BertEncoder with weights drawn as BertModel initialises them (normal, std 0.02; LayerNorm 1, 0)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = BertEncoder(shape)
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)
    return model.eval()


def load_bert_weights(model: BertEncoder, path: str | Path) -> list[str]:
    """Load a BertModel checkpoint (a model.safetensors, or a directory holding one) into `model`; returns
    the checkpoint's keys this encoder has no use for (position_ids, a pooler). A missing or misshapen weight
    raises, naming it."""
    from safetensors.torch import load_file

    path = Path(path)
    path = path / "model.safetensors" if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"no BERT checkpoint at {path}: give a model.safetensors or its directory")
    state = {k.removeprefix("bert."): v for k, v in load_file(str(path)).items()}
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    if missing:
        raise ValueError(f"{path} lacks {len(missing)} of this encoder's weights, e.g. {missing[:3]}: is it a "
                         f"BertModel of shape {model.shape}?")
    for k in own:
        if tuple(state[k].shape) != tuple(own[k].shape):
            raise ValueError(f"{path}: {k} is {tuple(state[k].shape)}, this encoder's is {tuple(own[k].shape)}")
    model.load_state_dict({k: state[k] for k in own})
    return sorted(set(state) - set(own))
