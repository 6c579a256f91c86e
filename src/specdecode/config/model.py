"""The model's shape: ``ModelConfig``, parsed from a Hugging Face ``config.json`` (GGUF files are
first converted to that form by ``models.gguf_loader``), so there is one source of truth for
model shapes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specdecode.errors import UnsupportedModelError

# model_type values whose HF checkpoints map onto our one Llama-family transformer.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "qwen2", "mistral")
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")


@dataclass(slots=True, frozen=True)
class RopeScaling:
    """RoPE frequency scaling as found in ``config.json``'s ``rope_scaling`` (None = plain RoPE)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"RoPE scaling type {self.rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}."
            )


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama 2/3, Qwen2/2.5, Mistral)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})."
            )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Parse a Hugging Face ``config.json`` dictionary; raise for unsupported architectures."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = cfg.get("architectures") or [model_type]
            raise UnsupportedModelError(
                f"Unsupported model architecture {archs[0]!r} (model_type={model_type!r}). "
                f"specdecode supports the Llama family: {', '.join(SUPPORTED_MODEL_TYPES)}."
            )
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        # transformers >= 5 writes rope_parameters (type, factors and theta); older configs
        # write rope_scaling plus a top-level rope_theta.
        scaling = cfg.get("rope_parameters") or cfg.get("rope_scaling")
        rope_scaling = None
        if scaling:
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            if rope_type != "default":
                rope_scaling = RopeScaling(
                    rope_type=rope_type,
                    factor=float(scaling.get("factor", 1.0)),
                    low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
                    high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
                    original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
                )
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None and isinstance(scaling, dict):
            rope_theta = scaling.get("rope_theta")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        # Qwen2 configs carry use_sliding_window=false next to a sliding_window value.
        window = cfg.get("sliding_window")
        if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
            window = None
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; Llama and Mistral say so with attention_bias.
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            rope_scaling=rope_scaling,
            sliding_window=int(window) if window else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
