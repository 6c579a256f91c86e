"""Draft heads that read the target's own features: Medusa heads and the EAGLE head.

Both work on the target's *feature*: the final hidden state after the last norm, the vector
the LM head turns into next-token logits (``ModelOutput.hidden``). Writing f_p for the feature
at position p (the target has read tokens 0..p), the target's own LM head on f_p predicts
token p + 1. The heads guess further:

- **Medusa** (Cai et al. 2024): head i (i = 1..K) maps f_p through a residual block
  x + SiLU(W_i x + b_i) to a vector whose logits predict token p + 1 + i. W_i starts at zero,
  so an untrained head predicts what the target's head does (token p + 1): training only has
  to learn the shift.
- **EAGLE** (Li et al. 2024): one decoder layer over fc([e(t_{p+1}); f_p]), the embedding of
  the next token next to the current feature, predicts f_{p+1}; its logits predict token
  p + 2, and the predicted feature is fed back to draft further (autoregression at the
  feature level, where it is far more regular than at the token level).

Logits come from a *reduced draft vocabulary* (``draft_vocab``: target token ids, most useful
first) through the head's own LM head, initialised from the target's rows for those tokens.
On a CPU the full head of the 1.5B demo target (151,936 x 1,536, 0.47 GB in bf16) would cost
each draft step 15% of a whole target pass; 32k rows cost a fifth of that. A token outside the
draft vocabulary is simply never proposed; verification stays lossless (q is zero there).

Heads are saved as ``heads.safetensors`` plus ``heads.json`` (``HeadConfig``) in a folder.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn

from specdecode.config import ModelConfig
from specdecode.errors import ModelLoadError
from specdecode.kv.static import KVCache, KVView
from specdecode.models.layers import Linear
from specdecode.models.llama import DecoderLayer, RMSNorm, rope_cos_sin, rope_inverse_frequencies

HEAD_KINDS = ("medusa", "eagle")
CONFIG_FILE = "heads.json"
WEIGHTS_FILE = "heads.safetensors"


@dataclass(slots=True, frozen=True)
class HeadConfig:
    """What a heads folder holds; enough to rebuild the module without the training run."""

    kind: str  # "medusa" or "eagle"
    hidden_size: int
    draft_vocab_size: int
    target_vocab_size: int
    num_heads: int = 4  # Medusa: heads (draft depth); EAGLE: unused (1 layer)
    # EAGLE's decoder layer shape (copied from the target's config at creation).
    num_attention_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    target_name: str = ""  # the target the heads were trained on (checked at load)
    # Medusa's static tree: paths of top-k ranks per depth, from measured accuracies.
    tree: tuple[tuple[int, ...], ...] = ()
    # Held-apart top-1 accuracy per head (Medusa) or per draft depth (EAGLE), for reports.
    accuracy: tuple[float, ...] = ()
    # Medusa: held-apart accuracy per head and top-k rank, so another --tree-size can be built.
    rank_accuracy: tuple[tuple[float, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in HEAD_KINDS:
            raise ModelLoadError(f"head kind must be one of {', '.join(HEAD_KINDS)}, got {self.kind!r}.")
        if not 0 < self.draft_vocab_size <= self.target_vocab_size:
            raise ModelLoadError(
                f"draft vocabulary of {self.draft_vocab_size} tokens does not fit the target's {self.target_vocab_size}."
            )

    @classmethod
    def for_target(cls, kind: str, target: ModelConfig, draft_vocab_size: int, num_heads: int = 4,
                   target_name: str = "") -> HeadConfig:
        return cls(
            kind=kind, hidden_size=target.hidden_size, draft_vocab_size=draft_vocab_size,
            target_vocab_size=target.vocab_size, num_heads=num_heads,
            num_attention_heads=target.num_heads, num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
            intermediate_size=target.intermediate_size, rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta, target_name=target_name,
        )

    def layer_config(self) -> ModelConfig:
        """The EAGLE decoder layer's shape as a one-layer ``ModelConfig``."""
        return ModelConfig(
            model_type="qwen2", vocab_size=self.target_vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=1, num_heads=self.num_attention_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, max_position_embeddings=1 << 20, tie_word_embeddings=False,
            attention_bias=False,
        )

    def check_target(self, target: ModelConfig) -> None:
        if target.hidden_size != self.hidden_size or target.vocab_size != self.target_vocab_size:
            raise ModelLoadError(
                f"These {self.kind} heads were trained for a target with hidden size {self.hidden_size} and "
                f"vocabulary {self.target_vocab_size}; this target has {target.hidden_size} and {target.vocab_size}. "
                f"Train heads for it with `specdecode train {self.kind}`."
            )


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W zero at start: the identity until trained."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = Linear(dim, dim, bias=True)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., C)
        return x + nn.functional.silu(self.linear(x))


class DraftHeads(nn.Module):
    """Shared by both kinds: the reduced draft vocabulary and its LM head."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        self.lm_head = Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        # draft row -> target token id; saved with the weights.
        self.register_buffer("draft_vocab", torch.arange(config.draft_vocab_size, dtype=torch.long))

    def init_vocab(self, draft_vocab: torch.Tensor, target_head: torch.Tensor) -> None:
        """draft_vocab (Vd,) long target ids; target_head (V, C): the target's LM head weight."""
        self.draft_vocab.copy_(draft_vocab)
        with torch.no_grad():
            self.lm_head.weight.copy_(target_head[draft_vocab].to(self.lm_head.weight.dtype))

    def draft_logits(self, x: torch.Tensor) -> torch.Tensor:  # (..., C) -> (..., Vd) float32
        return self.lm_head(x).float()

    def to_target_vocab(self, draft_rows: torch.Tensor) -> torch.Tensor:  # (...,) long draft rows -> target ids
        return self.draft_vocab[draft_rows]

    def save(self, folder: Path, dtype: torch.dtype | None = None) -> None:
        """Weights (floating ones cast to ``dtype``, e.g. the target's) and config into ``folder``."""
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        state = {
            name: (t.to(dtype) if dtype is not None and t.is_floating_point() else t).detach().contiguous().cpu()
            for name, t in self.state_dict().items()
        }
        save_file(state, str(folder / WEIGHTS_FILE))
        data = asdict(self.config)
        (folder / CONFIG_FILE).write_text(json.dumps(data, indent=2) + "\n")


class MedusaHeads(DraftHeads):
    def __init__(self, config: HeadConfig) -> None:
        super().__init__(config)
        self.blocks = nn.ModuleList(ResBlock(config.hidden_size) for _ in range(config.num_heads))

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # (..., C) -> (..., K, Vd) float32
        """Head i's logits for token p + 1 + i (i = 1..K) from the feature f_p."""
        stacked = torch.stack([block(features) for block in self.blocks], dim=-2)  # (..., K, C)
        # One matmul for all K heads: the (reduced) LM head is read once.
        return self.draft_logits(stacked)


class EagleHead(DraftHeads):
    def __init__(self, config: HeadConfig) -> None:
        super().__init__(config)
        layer_cfg = config.layer_config()
        self.fc = Linear(2 * config.hidden_size, config.hidden_size, bias=True)
        self.layer = DecoderLayer(layer_cfg)
        # The output is compared with the target's post-norm feature, so it is normed too.
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.register_buffer(
            "inv_freq", rope_inverse_frequencies(config.head_dim, config.rope_theta, None), persistent=False
        )

    def forward(
        self,
        features: torch.Tensor,  # (B, T, C) f_p: the target's (or the head's own predicted) features
        token_embeds: torch.Tensor,  # (B, T, C) e(t_{p+1}) from the target's embedding
        positions: torch.Tensor,  # (B, T) long: p + 1, the position of t_{p+1}
        cache: KVCache | None = None,
        view: KVView | None = None,
        contiguous_start: int | None = None,
        slots: torch.Tensor | None = None,  # (B, T) long: the cache slot of each row; None: ``positions``
    ) -> torch.Tensor:
        """Predicted features f_{p+1}: (B, T, C). Without a cache the T rows attend causally.

        ``slots`` apart from ``positions``: the drafter lays pair p at slot p but rotates it as
        position p + 1, and rows of several sequences (``drafters/batch_eagle.py``) write slots
        that differ per row, so no one ``contiguous_start`` names them."""
        x = self.fc(torch.cat([token_embeds.to(self.fc.weight.dtype), features.to(self.fc.weight.dtype)], dim=-1))
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        layer = self.layer
        written = slots if slots is not None else positions  # the attention writes the cache at these
        x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, 0, cache, written, view, contiguous_start)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)


def new_heads(config: HeadConfig) -> MedusaHeads | EagleHead:
    return MedusaHeads(config) if config.kind == "medusa" else EagleHead(config)


def load_heads(folder: str | Path, dtype: torch.dtype, device: torch.device) -> MedusaHeads | EagleHead:
    """Heads saved by ``DraftHeads.save`` (``specdecode train``), ready for inference."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise ModelLoadError(
            f"{folder} is not a heads folder (it needs {CONFIG_FILE} and {WEIGHTS_FILE}); "
            "make one with `specdecode train medusa|eagle`."
        )
    try:
        data = json.loads(config_path.read_text())
        data["tree"] = tuple(tuple(path) for path in data.get("tree", ()))
        data["accuracy"] = tuple(data.get("accuracy", ()))
        data["rank_accuracy"] = tuple(tuple(row) for row in data.get("rank_accuracy", ()))
        config = HeadConfig(**data)
    except (TypeError, ValueError) as err:
        raise ModelLoadError(f"{config_path} is not a valid heads config: {err}") from err
    heads = new_heads(config)
    state = load_file(str(weights_path))
    missing, unexpected = heads.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ModelLoadError(f"{weights_path} does not match {config.kind} heads: missing {missing}, unexpected {unexpected}.")
    heads = heads.to(device=device)
    for name, param in heads.named_parameters():
        param.data = param.data.to(dtype)
    heads.draft_vocab = heads.draft_vocab.to(device)
    return heads.eval().requires_grad_(False)


def with_report(
    config: HeadConfig,
    tree: tuple[tuple[int, ...], ...],
    accuracy: tuple[float, ...],
    rank_accuracy: tuple[tuple[float, ...], ...] = (),
) -> HeadConfig:
    return replace(config, tree=tree, accuracy=accuracy, rank_accuracy=rank_accuracy)
