"""Reading a GGUF file's metadata: opening it safely and turning its ``general.*`` and
``<arch>.*`` keys into a Hugging Face ``config.json`` for the torch backend.

The torch backend implements the Llama family; GGUF files of other architectures run on the
llama.cpp backend, which reads them itself.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from specdecode.errors import ModelLoadError, UnsupportedModelError

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2")
_HF_ARCHITECTURE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_GGUF_MAGIC = b"GGUF"
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1 RoPE scaling, folded into config.json
# Llama 3.1's RoPE scaling constants; GGUF stores only the resulting per-frequency factors.
_LLAMA3_LOW_FREQ_FACTOR = 1.0
_LLAMA3_HIGH_FREQ_FACTOR = 4.0
_LLAMA3_ORIGINAL_CONTEXT = 8192
_DEFAULT_ROPE_THETA = 10_000.0  # llama.cpp's default when rope.freq_base is absent


def open_gguf(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist (or is not a file). Check the path.")
    with path.open("rb") as handle:
        magic = handle.read(len(_GGUF_MAGIC))
    if magic != _GGUF_MAGIC:
        raise ModelLoadError(
            f"{path} is not a GGUF file (it does not start with the bytes 'GGUF'). "
            "Pass a .gguf file, or a Hugging Face model folder with config.json."
        )
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError) as err:
        raise ModelLoadError(
            f"{path} could not be read as GGUF ({type(err).__name__}: {err}); the file is probably "
            "truncated or corrupt. Download it again."
        ) from err
    file_size = path.stat().st_size
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > file_size:
            raise ModelLoadError(
                f"{path} is truncated: tensor {tensor.name} ends at byte {tensor.data_offset + tensor.n_bytes} "
                f"but the file has {file_size} bytes. Download it again."
            )
    return reader


def architecture(metadata: dict[str, Any], source: Path) -> str:
    arch = metadata.get("general.architecture")
    if arch is None:
        raise ModelLoadError(f"{source} has no general.architecture metadata; it is not a model GGUF file.")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{source} holds a {arch!r} model; specdecode converts GGUF architectures "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)} (Mistral GGUFs are 'llama')."
        )
    if int(metadata.get("split.count", 1)) > 1:
        raise UnsupportedModelError(
            f"{source} is one part of a split GGUF; merge the parts first "
            "(llama.cpp: llama-gguf-split --merge first-part.gguf merged.gguf)."
        )
    return arch


def hf_config(
    metadata: dict[str, Any], arch: str, tensors: dict[str, Any], dtype: torch.dtype, source: Path
) -> dict[str, Any]:
    def optional(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if isinstance(value, list):
            raise UnsupportedModelError(f"{source}: per-layer {arch}.{key} values are not supported.")
        return value

    def required(key: str) -> Any:
        value = optional(key)
        if value is None:
            raise ModelLoadError(f"{source} lacks the metadata key {arch}.{key}; the file is incomplete.")
        return value

    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{source} has no token_embd.weight tensor; it is not a complete model.")
    num_heads = int(required("attention.head_count"))
    num_kv_heads = int(optional("attention.head_count_kv") or num_heads)
    hidden_size = int(required("embedding_length"))
    key_length = optional("attention.key_length")
    head_dim = int(key_length or hidden_size // num_heads)
    eos_token_id = metadata.get("tokenizer.ggml.eos_token_id")
    config: dict[str, Any] = {
        "architectures": [_HF_ARCHITECTURE[arch]],
        "model_type": arch,
        "hidden_size": hidden_size,
        "intermediate_size": int(required("feed_forward_length")),
        "num_hidden_layers": int(required("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "rms_norm_eps": float(required("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(required("context_length")),
        # GGUF shapes are fastest-dimension-first: token_embd is [hidden, vocab].
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_token_id,
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": _DTYPE_NAMES[dtype],  # transformers < 5 reads this name,
        "dtype": _DTYPE_NAMES[dtype],  # transformers >= 5 this one
        "use_cache": True,
    }
    if key_length is not None:
        config["head_dim"] = head_dim
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config["mlp_bias"] = False
    rope_freqs = tensors.get(_ROPE_FREQS)
    config.update(_rope_config(metadata, arch, rope_freqs, head_dim, source))
    return config


def _rope_config(metadata: dict[str, Any], arch: str, rope_freqs: Any, head_dim: int, source: Path) -> dict[str, Any]:
    """``rope_theta``, ``rope_parameters`` (transformers >= 5) and ``rope_scaling`` (older) entries."""
    theta = float(metadata.get(f"{arch}.rope.freq_base") or _DEFAULT_ROPE_THETA)
    scaling_type = metadata.get(f"{arch}.rope.scaling.type", "none")
    params: dict[str, Any] = {"rope_type": "default"}
    if rope_freqs is not None:
        params = _llama3_rope_parameters(metadata, arch, rope_freqs, theta, head_dim, source)
    elif scaling_type == "linear":
        params = {"rope_type": "linear", "factor": float(metadata[f"{arch}.rope.scaling.factor"])}
    elif scaling_type != "none":
        raise UnsupportedModelError(
            f"{source} uses RoPE scaling {scaling_type!r}; supported: none, linear, and Llama 3.1-style factors."
        )
    config: dict[str, Any] = {"rope_theta": theta, "rope_parameters": {**params, "rope_theta": theta}}
    if params["rope_type"] != "default":
        config["rope_scaling"] = params
    return config


def _llama3_rope_parameters(
    metadata: dict[str, Any], arch: str, rope_freqs: Any, theta: float, head_dim: int, source: Path
) -> dict[str, Any]:
    """Recover Llama 3.1's RoPE scaling parameters from the per-frequency factors GGUF stores.

    GGUF keeps only the resulting divisors of each inverse frequency; HF's config wants the
    parameters. We assume Llama 3.1's constants, recompute the factors and insist they match.
    """
    stored = np.asarray(gguf.quants.dequantize(rope_freqs.data, rope_freqs.tensor_type), dtype=np.float64).ravel()
    rope_dims = int(metadata.get(f"{arch}.rope.dimension_count") or head_dim)
    original_context = int(metadata.get(f"{arch}.rope.scaling.original_context_length") or _LLAMA3_ORIGINAL_CONTEXT)
    factor = float(stored.max())
    inv_freq = theta ** (-np.arange(0, rope_dims, 2, dtype=np.float64) / rope_dims)  # (rope_dims / 2,)
    wavelength = 2 * math.pi / inv_freq
    low, high = _LLAMA3_LOW_FREQ_FACTOR, _LLAMA3_HIGH_FREQ_FACTOR
    smooth = (original_context / wavelength - low) / (high - low)
    expected = np.where(
        wavelength < original_context / high,
        1.0,
        np.where(wavelength > original_context / low, factor, 1 / ((1 - smooth) / factor + smooth)),
    )
    if stored.shape != expected.shape or not np.allclose(stored, expected, rtol=1e-3):
        raise UnsupportedModelError(
            f"{source} has a {_ROPE_FREQS} tensor that does not match Llama 3.1's RoPE scaling; "
            "this RoPE variant is not supported."
        )
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": _LLAMA3_LOW_FREQ_FACTOR,
        "high_freq_factor": _LLAMA3_HIGH_FREQ_FACTOR,
        "original_max_position_embeddings": original_context,
    }


def generation_config(config: dict[str, Any]) -> dict[str, Any]:
    return {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if config[key] is not None}
