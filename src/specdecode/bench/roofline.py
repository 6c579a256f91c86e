"""The physical limit: bytes of weights read per forward pass, and memory bandwidth.

Decoding one token reads every weight of the model once, so on a bandwidth-bound machine
plain decoding cannot beat ``bandwidth / weight_bytes`` tokens/s. A speculative step reads
the target once and the draft once per drafted token, and emits tau tokens, which gives the
ceiling ``tau * bandwidth / (target_bytes + k * draft_bytes)``. We evaluate it with the
counts each run measured (target and draft forward passes, new tokens), which is the same
formula with k the measured draft passes per step; the prefill pass counts as one more
weight read. The ceiling ignores KV-cache and activation traffic and compute, so real runs
sit below it; long prompts (compute-bound prefill) sit further below.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from specdecode.config import ModelConfig

DEFAULT_PROBE_BYTES = 1 << 30  # well past any last-level cache
PROBE_REPEATS = 7


def weight_bytes_per_forward(config: ModelConfig, dtype: torch.dtype, quant: str = "none") -> int:
    """Bytes of weights one forward pass reads (the embedding table contributes one row,
    except that a tied LM head reads it whole).

    With ``quant`` (``models.quantize``) the projections and the LM head count as stored: int8 one
    byte per weight plus an fp32 scale per output row, int4 half a byte plus a (scale, zero)
    pair in ``dtype`` per group of ``DEFAULT_INT4_GROUP``; norms and biases stay in ``dtype``.
    """
    from specdecode.models.quantize import DEFAULT_INT4_GROUP

    element = torch.empty((), dtype=dtype).element_size()
    hidden, inter = config.hidden_size, config.intermediate_size
    q_dim = config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim
    # (out_features, in_features) of every projection one token reads, LM head last.
    matrices = [(q_dim + 2 * kv_dim, hidden), (hidden, q_dim), (2 * inter, hidden), (hidden, inter)] * config.num_layers
    matrices.append((config.vocab_size, hidden))
    small = config.num_layers * 2 * hidden + hidden  # norms
    if config.attention_bias:
        small += config.num_layers * (q_dim + 2 * kv_dim)
    if quant == "int8":
        stored = sum(n * k + 4 * n for n, k in matrices)
    elif quant == "int4":
        stored = sum(n * k // 2 + 2 * element * n * (k // DEFAULT_INT4_GROUP) for n, k in matrices)
    else:
        stored = sum(n * k for n, k in matrices) * element
    return stored + small * element


GGUF_TOKEN_EMBEDDING = "token_embd.weight"
GGUF_LM_HEAD = "output.weight"  # absent when the LM head is tied to the embedding table


def gguf_weight_bytes_per_forward(path: str | Path) -> int:
    """Bytes of weights one llama.cpp forward pass reads from a GGUF file, as stored there
    (its own quantization), by the rule of ``weight_bytes_per_forward``: every tensor once,
    except an untied embedding table, of which a token reads one row, left out as there.

    Why not llama.cpp's ``llama_model_size``: it counts the whole embedding table, which a
    decoding step does not read; on a small model with a large vocabulary that is a third of it.
    """
    import gguf

    tensors = {tensor.name: tensor for tensor in gguf.GGUFReader(str(path)).tensors}
    total = sum(int(tensor.n_bytes) for tensor in tensors.values())
    embedding = tensors.get(GGUF_TOKEN_EMBEDDING)
    if embedding is not None and GGUF_LM_HEAD in tensors:
        total -= int(embedding.n_bytes)
    return total


def measure_copy_bandwidth(
    device: torch.device, num_bytes: int = DEFAULT_PROBE_BYTES, repeats: int = PROBE_REPEATS
) -> float:
    """Best bytes/s over a few copies of a large tensor, counting bytes read plus bytes written.

    The best, not the median: the ceiling is what the memory system can deliver, and a copy
    only runs slower than that when something else (another process, frequency drops)
    interferes.
    """
    elements = num_bytes // 2
    src = torch.ones(elements, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # page in both buffers
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - started)
    del src, dst
    return 2 * elements * 2 / min(seconds)


def ceiling_tokens_per_second(
    new_tokens: int,
    target_passes: int,
    draft_passes: int,
    target_bytes: int,
    draft_bytes: int,
    bandwidth: float,  # bytes/s
) -> float | None:
    """Tokens/s if every weight byte were read at ``bandwidth`` and nothing else cost time."""
    bytes_read = target_passes * target_bytes + draft_passes * draft_bytes
    if bytes_read <= 0 or new_tokens <= 0:
        return None
    return new_tokens * bandwidth / bytes_read
