"""One decoder-only transformer for the Llama family (Llama 2/3, Qwen2/2.5, Mistral).

Differences between family members are configuration, not code: q/k/v bias (Qwen2), tied
embeddings, RoPE theta and scaling, grouped-query attention, sliding windows (Mistral).

``Transformer.forward`` takes token ids, their positions, a KV cache owned by the caller
(the engine) and what the pass may read from it, and returns logits plus hidden states. It
can also run a subset of layers (self-speculation) and return chosen layers' hidden states
(EAGLE-style drafters). The module holds weights only: no decoding state lives here.

Parameter names follow Hugging Face checkpoints minus the ``model.`` prefix, except that the
q/k/v projections are one ``qkv_proj`` and gate/up one ``gate_up_proj`` (one weight read and
one kernel call instead of three or two: the 0.5B draft's projections for one token took
33.8 ms fused against 39.4 ms separate on this CPU). ``FUSED_PROJECTIONS`` says how the
loader stacks checkpoint tensors into them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.config import ModelConfig, RopeScaling
from specdecode.kv.static import KVCache, KVView, causal_view
from specdecode.models.layers import Linear


@dataclass(slots=True)
class ModelOutput:
    logits: torch.Tensor | None  # (B, T_logits, V) float32, or None when not asked for
    hidden: torch.Tensor  # (B, T, C) after the final norm: the "feature" before the LM head
    layer_hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (B, T, C)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., C)
        # Normalise in fp32 and scale in the model dtype, as the reference implementations do,
        # so bf16 logits match theirs.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """(D/2,) float32 inverse frequencies, with Llama 3 / linear scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None or scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(middle, blended, scaled)


def rope_cos_sin(
    inv_freq: torch.Tensor,  # (D/2,) float32
    positions: torch.Tensor,  # (B, T) long
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin of shape (B, T, 1, D) for positions (B, T), for ``apply_rope``.

    The sin's first half is negated here, once per forward, so that rotating a head is
    x * cos + roll(x, D/2) * sin: the reference's x * cos + cat(-x2, x1) * sin, bit for bit
    (negation is exact), in 4 ops instead of 6."""
    freqs = positions[..., None].float() * inv_freq.float()  # (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None]
    sin = emb.sin()
    half = sin.shape[-1] // 2
    return emb.cos().to(dtype), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).to(dtype)


def apply_rope(
    x: torch.Tensor,  # (B, T, H, D)
    cos: torch.Tensor,  # (B, T, 1, D)
    signed_sin: torch.Tensor,  # (B, T, 1, D) from rope_cos_sin
) -> torch.Tensor:  # (B, T, H, D)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


# Fused parameter -> the checkpoint tensors stacked (along the output dim) to make it, in order.
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def component_names(name: str) -> tuple[str, ...] | None:
    """For a fused parameter (``layers.3.self_attn.qkv_proj.weight``), the checkpoint tensors
    stacked to make it (``layers.3.self_attn.q_proj.weight``, ...); None for any other."""
    for fused, parts in FUSED_PROJECTIONS.items():
        marker = f".{fused}."
        if marker in name:
            head, tail = name.split(marker)
            return tuple(f"{head}.{part}.{tail}" for part in parts)
    return None


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # (B, T, C)
        cos: torch.Tensor,  # (B, T, 1, D)
        sin: torch.Tensor,  # (B, T, 1, D) signed, from rope_cos_sin
        layer: int,
        cache: KVCache | None,
        positions: torch.Tensor,  # (B, T)
        view: KVView | None,
        contiguous_start: int | None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        heads = self.qkv_proj(x).reshape(batch, seq, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        # Queries and keys are rotated in one go (one set of elementwise ops, not two).
        qk = apply_rope(heads[:, :, : self.num_heads + self.num_kv_heads], cos, sin)
        q = qk[:, :, : self.num_heads].transpose(1, 2)  # (B, H, T, D)
        k = qk[:, :, self.num_heads :].transpose(1, 2)  # (B, H_kv, T, D)
        v = heads[:, :, self.num_heads + self.num_kv_heads :].transpose(1, 2)
        if cache is not None:
            assert view is not None, "a cached forward needs a KVView"
            cache.write(layer, positions, k, v, contiguous_start)
            k, v = cache.read(layer, view.kv_len)
            mask = view.mask
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        elif view is not None and view.mask is not None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=view.mask, enable_gqa=True)
        else:
            # No cache: the T tokens attend causally among themselves.
            out = F.scaled_dot_product_attention(q, k, v, is_causal=seq > 1, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, C)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class Transformer(nn.Module):
    """Token ids in; logits and hidden states out. Weights only: the caller owns the cache."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Cos/sin are computed per call from positions: a (max_pos, D) table for a 32k
        # context would cost more memory than the small per-step computation.
        self.register_buffer(
            "inv_freq",
            rope_inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling),
            persistent=False,
        )

    def tie_weights(self) -> None:
        self.lm_head.weight = self.embed_tokens.weight

    def pack_weights_for_cpu(self) -> int:
        """Prepack every projection for the CPU bf16 kernels (see ``layers``); returns how many.

        For inference only: packed layers keep no dense weight, so no state_dict or training.
        """
        return sum(module.pack_for_cpu() for module in self.modules() if isinstance(module, Linear))

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of shape (B, T, 1, D) for positions (B, T) (see ``rope_cos_sin``)."""
        return rope_cos_sin(self.inv_freq, positions, dtype)

    def forward(
        self,
        token_ids: torch.Tensor,  # (B, T) long
        positions: torch.Tensor,  # (B, T) long
        cache: KVCache | None = None,
        view: KVView | None = None,
        *,
        layers: Sequence[int] | None = None,
        return_layers: Sequence[int] = (),
        logits_last: int | None = None,
        compute_logits: bool = True,
        contiguous_start: int | None = None,
    ) -> ModelOutput:
        """Run the decoder.

        layers:        indices of the layers to run (in order); None runs all. Skipped layers
                       neither read nor write the cache.
        return_layers: layer indices whose output hidden states (before the final norm) to return.
        logits_last:   compute logits for the last ``n`` positions only (prefill needs 1).
        contiguous_start: host-side hint that every sequence's tokens occupy cache slots
                       [start, start + T), which turns the cache write into a slice copy.
        """
        x = self.embed_tokens(token_ids)
        x, layer_hidden = self.run_layers(x, positions, cache, view, layers, return_layers, contiguous_start)
        hidden = self.norm(x)
        logits = None
        if compute_logits:
            head_in = hidden if logits_last is None else hidden[:, -logits_last:]
            logits = self.lm_head(head_in).float()
        return ModelOutput(logits=logits, hidden=hidden, layer_hidden=layer_hidden)

    def run_layers(
        self,
        x: torch.Tensor,  # (B, T, C) residual stream entering the first layer run
        positions: torch.Tensor,  # (B, T) long
        cache: KVCache | None = None,
        view: KVView | None = None,
        layers: Sequence[int] | None = None,
        return_layers: Sequence[int] = (),
        contiguous_start: int | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The decoder layers alone (``forward`` without embedding, final norm and head): the
        residual stream after ``layers`` and the outputs of ``return_layers``. Distillation
        runs the trainable top layers from cached features of the frozen ones through this."""
        cos, sin = self.rope(positions, x.dtype)
        layer_ids = range(len(self.layers)) if layers is None else layers
        wanted = set(return_layers)
        layer_hidden: dict[int, torch.Tensor] = {}
        for idx in layer_ids:
            layer = self.layers[idx]
            h = layer.input_layernorm(x)
            x = x + layer.self_attn(h, cos, sin, idx, cache, positions, view, contiguous_start)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if idx in wanted:
                layer_hidden[idx] = x
        return x, layer_hidden

    def extend(self, cache: KVCache, tokens: torch.Tensor, start: int, **kwargs) -> ModelOutput:
        """Feed tokens (1, T) at positions start .. start + T - 1, appending to ``cache``.

        The common case of decoding one sequence: positions, the causal view and the cache
        write all follow from ``start``. Keyword arguments go to ``forward``. The caller still
        owns the cache's length bookkeeping.
        """
        length = tokens.shape[1]
        host_positions = [list(range(start, start + length))]
        positions = torch.arange(start, start + length, device=tokens.device)[None]
        view = causal_view(positions, host_positions, self.config.sliding_window)
        return self(tokens, positions, cache, view, contiguous_start=start, **kwargs)
