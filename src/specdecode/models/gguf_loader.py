"""Convert a GGUF file (llama.cpp's format) into a Hugging Face-format model folder, once.

The rest of specdecode reads only HF folders (``config.json``, ``model.safetensors``,
tokenizer files), so a GGUF model is converted on first use into
``cache_dir()/converted/<stem>-<dtype>-<hash>`` and reused after that. Quantized tensors are
dequantized (specdecode computes in bf16/fp16/fp32), which makes the folder larger than the
GGUF but lets one weight loader and one transformer serve every source.

Two layout differences from HF are undone here:
- GGML lists tensor dimensions fastest-first; ``gguf.quants.dequantize`` already returns
  numpy (row-major) order, which is HF's ``(out_features, in_features)``.
- For the ``llama`` architecture, llama.cpp's converter reorders the rows of each attention
  head in ``attn_q``/``attn_k`` so that the two members of a rotary pair are adjacent (GGML's
  RoPE); HF's rotate-half RoPE wants them half a head apart. ``qwen2`` files use NEOX RoPE,
  which is HF's layout, and are not reordered.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tqdm.auto import tqdm

from specdecode.core.paths import cache_dir
from specdecode.errors import ModelLoadError, UnsupportedModelError
from specdecode.models.gguf_metadata import (
    _DTYPE_NAMES,
    _ROPE_FREQS,
    architecture,
    generation_config,
    hf_config,
    open_gguf,
)
from specdecode.models.gguf_tokenizer import write_hf_tokenizer

# Bump when the converter's output changes, so folders converted by an older version are redone.
CONVERTER_VERSION = 1

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {  # GGUF "blk.{i}.<key>" -> HF "model.layers.{i}.<value>"
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_REQUIRED_LAYER_TENSORS = tuple(k for k in _LAYER_TENSORS if k.endswith(".weight"))
_QWEN2_BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias")


@dataclass(slots=True)
class _PlannedTensor:
    hf_name: str
    shape: tuple[int, ...]  # HF order
    source: Any  # gguf.ReaderTensor, or None for a tensor of zeros
    unpermute_heads: int | None = None  # llama q/k: heads to undo llama.cpp's row order over


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, dtype: torch.dtype, show_progress: bool = True) -> Path:
    """Write the HF-format equivalent of a GGUF model into ``out_dir`` (which must not exist or be empty).

    Weights are dequantized to float32 and cast to ``dtype`` (float32, float16 or bfloat16).
    The folder is built next to ``out_dir`` and renamed into place, so ``out_dir`` is either
    absent or complete. Returns ``out_dir``.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {list(_DTYPE_NAMES.values())}, got {dtype}")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ModelLoadError(f"{out_dir} already exists and is not empty; remove it or choose another folder.")
    if show_progress:  # parsing a 150k-token vocabulary takes seconds before the bar appears
        tqdm.write(f"Reading {gguf_path.name} ...", file=sys.stderr)  # stdout is for generated text
    reader = open_gguf(gguf_path)
    metadata = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    arch = architecture(metadata, gguf_path)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    config = hf_config(metadata, arch, tensors, dtype, gguf_path)
    plan = _plan_tensors(tensors, config, arch, gguf_path)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        write_hf_tokenizer(metadata, work_dir, gguf_path)
        (work_dir / "config.json").write_text(json.dumps(config, indent=2))
        (work_dir / "generation_config.json").write_text(json.dumps(generation_config(config), indent=2))
        _write_weights(work_dir / "model.safetensors", plan, dtype, gguf_path, show_progress)
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above); rename cannot replace a directory otherwise
        os.rename(work_dir, out_dir)
    except OSError as err:
        raise ModelLoadError(f"Could not write the converted model to {out_dir}: {err}") from err
    finally:
        if work_dir.exists():
            shutil.rmtree(work_dir, ignore_errors=True)
    return out_dir


@dataclass(slots=True)
class StoredTensor:
    """A weight as the GGUF file stores it, before any dequantization."""

    type_name: str  # GGML type, e.g. "Q4_K", "Q6_K", "F16"
    raw: Any  # numpy view of the stored bytes (memory-mapped)
    shape: tuple[int, ...]  # HF order: (out_features, in_features)
    unpermute_heads: int | None  # llama q/k: rows to reorder after decoding (see unpermute_rotary_rows)


def stored_weights(gguf_path: Path) -> dict[str, StoredTensor]:
    """HF parameter name (without ``model.``) -> the GGUF's stored tensor, for quantizers that
    can take a GGUF's own quantized blocks instead of requantizing the dequantized weight."""
    reader = open_gguf(Path(gguf_path))
    metadata = {name: field.contents() for name, field in reader.fields.items() if not name.startswith(("GGUF.", "tokenizer."))}
    arch = architecture(metadata, gguf_path)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    config = hf_config(metadata, arch, tensors, torch.float32, gguf_path)
    return {
        planned.hf_name.removeprefix("model."): StoredTensor(
            planned.source.tensor_type.name, planned.source.data, planned.shape, planned.unpermute_heads
        )
        for planned in _plan_tensors(tensors, config, arch, gguf_path)
        if planned.source is not None
    }


def cached_hf_folder_for_gguf(gguf_path: Path, dtype: torch.dtype, show_progress: bool = True) -> Path:
    """The HF-format folder for a GGUF file in ``dtype``, converting it into the cache on first use.

    The cache key covers the file's resolved path, size and modification time, the dtype and
    ``CONVERTER_VERSION``, so a replaced file or a new converter gives a new folder. A cache
    hit reads nothing from the GGUF file.
    """
    gguf_path = Path(gguf_path).expanduser()
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file {gguf_path} does not exist (or is not a file). Check the path.")
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {list(_DTYPE_NAMES.values())}, got {dtype}")
    resolved = gguf_path.resolve()
    stat = resolved.stat()
    key_text = f"{resolved}|{stat.st_size}|{stat.st_mtime_ns}|{_DTYPE_NAMES[dtype]}|{CONVERTER_VERSION}"
    digest = hashlib.sha256(key_text.encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", resolved.stem)[:80]
    folder = cache_dir() / "converted" / f"{stem}-{_DTYPE_NAMES[dtype]}-{digest}"
    if _is_converted(folder):
        return folder
    try:
        return convert_gguf_to_hf(resolved, folder, dtype, show_progress=show_progress)
    except ModelLoadError:
        if _is_converted(folder):  # another process converted the same file meanwhile
            return folder
        raise


def _is_converted(folder: Path) -> bool:
    # Folders appear by atomic rename only when complete, so presence means done.
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def _expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF shape of each GGUF tensor name, as config.json implies (for one layer: blk.0)."""
    hidden, ffn, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config.get("head_dim", hidden // config["num_attention_heads"])
    q_rows = config["num_attention_heads"] * head_dim
    kv_rows = config["num_key_value_heads"] * head_dim
    return {
        "token_embd.weight": (vocab, hidden),
        "output.weight": (vocab, hidden),
        "output_norm.weight": (hidden,),
        "attn_norm.weight": (hidden,),
        "ffn_norm.weight": (hidden,),
        "attn_q.weight": (q_rows, hidden),
        "attn_k.weight": (kv_rows, hidden),
        "attn_v.weight": (kv_rows, hidden),
        "attn_output.weight": (hidden, q_rows),
        "attn_q.bias": (q_rows,),
        "attn_k.bias": (kv_rows,),
        "attn_v.bias": (kv_rows,),
        "attn_output.bias": (hidden,),
        "ffn_gate.weight": (ffn, hidden),
        "ffn_up.weight": (ffn, hidden),
        "ffn_down.weight": (hidden, ffn),
    }


def _plan_tensors(tensors: dict[str, Any], config: dict[str, Any], arch: str, source: Path) -> list[_PlannedTensor]:
    """Map every GGUF tensor to its HF name and shape, failing before any slow work if one is wrong."""
    num_layers = config["num_hidden_layers"]
    expected_shapes = _expected_shapes(config)
    plan: list[_PlannedTensor] = []
    for name, tensor in tensors.items():
        if name == _ROPE_FREQS:
            continue  # folded into config.json's RoPE scaling
        layer, key = _split_layer_name(name)
        if layer is not None and key in _LAYER_TENSORS and layer < num_layers:
            hf_name = f"model.layers.{layer}.{_LAYER_TENSORS[key]}"
        elif layer is None and name in _GLOBAL_TENSORS:
            hf_name = _GLOBAL_TENSORS[name]
        else:
            raise UnsupportedModelError(
                f"{source} has a tensor {name!r} that a {arch} model does not have; this GGUF variant is not supported."
            )
        shape = tuple(int(dim) for dim in reversed(tensor.shape.tolist()))
        if shape != expected_shapes[key]:
            raise ModelLoadError(
                f"{source}: tensor {name} has shape {shape} but the metadata implies {expected_shapes[key]}."
            )
        _check_dequantizable(tensor, source)
        heads = None
        if arch == "llama" and key.startswith(("attn_q.", "attn_k.")):
            heads = config["num_attention_heads"] if key.startswith("attn_q.") else config["num_key_value_heads"]
        plan.append(_PlannedTensor(hf_name, shape, tensor, heads))

    required = [f"blk.{i}.{key}" for i in range(num_layers) for key in _REQUIRED_LAYER_TENSORS]
    required.append("output_norm.weight")
    if arch == "qwen2":
        required += [f"blk.{i}.{key}" for i in range(num_layers) for key in _QWEN2_BIASES]
    missing = [name for name in required if name not in tensors]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelLoadError(f"{source} lacks the tensors {', '.join(missing[:3])}{more}; the file is incomplete.")
    if config.get("attention_bias"):
        # HF's Llama puts a bias on o_proj too whenever attention_bias is set; GGUF may omit it.
        for i in range(num_layers):
            if f"blk.{i}.attn_output.bias" not in tensors:
                plan.append(_PlannedTensor(f"model.layers.{i}.self_attn.o_proj.bias", (config["hidden_size"],), None))
    return sorted(plan, key=lambda item: _natural_key(item.hf_name))


def _split_layer_name(name: str) -> tuple[int | None, str]:
    """("blk.3.attn_q.weight") -> (3, "attn_q.weight"); names outside layers -> (None, name)."""
    match = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    return (int(match.group(1)), match.group(2)) if match else (None, name)


def _natural_key(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _check_dequantizable(tensor: Any, source: Path) -> None:
    # Dequantize one row: cheap, and it fails exactly when the full tensor would.
    first_row = tensor.data.reshape(-1, tensor.data.shape[-1])[:1]
    try:
        gguf.quants.dequantize(first_row, tensor.tensor_type)
    except NotImplementedError as err:
        raise UnsupportedModelError(
            f"{source}: tensor {tensor.name} has type {tensor.tensor_type.name}, which specdecode cannot "
            "dequantize. Use a GGUF quantized with a common type (Q4_K_M, Q5_K_M, Q6_K, Q8_0, F16)."
        ) from err


def _dequantize(planned: _PlannedTensor) -> torch.Tensor:
    """The planned tensor in HF layout as float32; shape ``planned.shape``."""
    if planned.source is None:
        return torch.zeros(planned.shape, dtype=torch.float32)
    values = gguf.quants.dequantize(planned.source.data, planned.source.tensor_type)
    values = np.array(values, dtype=np.float32, copy=not values.flags.writeable)  # memmap views are read-only
    weight = torch.from_numpy(values).reshape(planned.shape)
    if planned.unpermute_heads is not None:
        weight = unpermute_rotary_rows(weight, planned.unpermute_heads)
    return weight


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: weight (num_heads * head_dim, ...) from pair-adjacent to rotate-half.

    Within a head llama.cpp stores rows as (x0, y0, x1, y1, ...), each rotary pair adjacent;
    HF stores (x0, x1, ..., y0, y1, ...). Viewing the rows as (head, pair, member) and swapping
    the last two axes gives HF's (head, member, pair).
    """
    half_head = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half_head, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _write_weights(
    path: Path, plan: list[_PlannedTensor], dtype: torch.dtype, source: Path, show_progress: bool
) -> None:
    """Write a safetensors file one tensor at a time, so peak memory is one float32 tensor.

    safetensors' own ``save_file`` needs every tensor in memory at once, about the size of the
    whole converted model; streaming the known layout avoids that.
    """
    element_size = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for planned in plan:
        size = math.prod(planned.shape) * element_size
        header[planned.hf_name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(planned.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # the format pads the header to 8 bytes
    with path.open("wb") as handle:
        handle.write(len(header_bytes).to_bytes(8, "little"))
        handle.write(header_bytes)
        for planned in tqdm(plan, desc=f"Converting {source.name}", unit="tensor", disable=not show_progress):
            tensor = _dequantize(planned).to(dtype).contiguous()
            handle.write(tensor.view(-1).view(torch.uint8).numpy())
