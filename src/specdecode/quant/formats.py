"""Quantized weight formats as pure functions: quantize, dequantize, and read GGUF's Q4_K exactly.

int8: symmetric, one fp32 scale per output channel (row): ``w ~ q * scale``, q in [-127, 127].
int4: asymmetric groups of ``group_size`` along the input dimension, in the form torch's int4
      kernels take: ``w ~ (q - 8) * scale + zero``, q in [0, 15], one (scale, zero) per group.

GGUF's Q4_K stores 256-weight super-blocks of eight 32-weight sub-blocks, each with a 6-bit
scale and min: ``w = d * sc * q - dmin * m``. That is exactly the int4 form above with group 32,
``scale = d * sc`` and ``zero = 8 * scale - dmin * m``, so a Q4_K tensor becomes int4 without
requantizing (``int4_from_q4_k``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

INT8_MAX = 127
INT4_LEVELS = 15  # q in 0..15
INT4_OFFSET = 8  # torch's int4 kernels compute (q - 8) * scale + zero
Q4_K_BLOCK_WEIGHTS = 256
Q4_K_BLOCK_BYTES = 144  # fp16 d, fp16 dmin, 12 bytes of packed 6-bit scales/mins, 128 bytes of nibbles
Q4_K_GROUP = 32


@dataclass(slots=True)
class Int8Weights:
    qweight: torch.Tensor  # (N, K) int8
    scales: torch.Tensor  # (N,) float32


@dataclass(slots=True)
class Int4Weights:
    qweight: torch.Tensor  # (N, K) uint8, values 0..15
    scales: torch.Tensor  # (N, K // group_size) float32
    zeros: torch.Tensor  # (N, K // group_size) float32
    group_size: int


def quantize_int8(weight: torch.Tensor) -> Int8Weights:  # weight: (N, K) float
    """Round each row to int8 with the scale that maps its largest magnitude to 127."""
    w = weight.float()
    absmax = w.abs().amax(dim=1)
    scales = torch.where(absmax > 0, absmax / INT8_MAX, torch.ones_like(absmax))
    qweight = torch.round(w / scales[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weights(qweight, scales)


def dequantize_int8(weights: Int8Weights) -> torch.Tensor:  # -> (N, K) float32
    return weights.qweight.float() * weights.scales[:, None]


def quantize_int4(weight: torch.Tensor, group_size: int) -> Int4Weights:  # weight: (N, K) float
    """Min/max (asymmetric) 4-bit groups of ``group_size`` consecutive inputs per row."""
    rows, cols = weight.shape
    if cols % group_size:
        raise ValueError(f"int4 groups of {group_size} need an input size divisible by it, got {cols}")
    w = weight.float().reshape(rows, cols // group_size, group_size)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scales = (high - low) / INT4_LEVELS
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((w - low[..., None]) / scales[..., None]).clamp_(0, INT4_LEVELS).to(torch.uint8)
    zeros = low + INT4_OFFSET * scales
    return Int4Weights(q.reshape(rows, cols), scales, zeros, group_size)


def dequantize_int4(weights: Int4Weights) -> torch.Tensor:  # -> (N, K) float32
    rows, cols = weights.qweight.shape
    q = weights.qweight.float().reshape(rows, cols // weights.group_size, weights.group_size)
    w = (q - INT4_OFFSET) * weights.scales[..., None] + weights.zeros[..., None]
    return w.reshape(rows, cols)


def _q4_k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(B, 12) uint8 -> two (B, 8) arrays of 6-bit sub-block scales and mins (ggml's get_scale_min_k4)."""
    p = packed.astype(np.int32)
    sc = np.empty((p.shape[0], 8), dtype=np.int32)
    mn = np.empty((p.shape[0], 8), dtype=np.int32)
    sc[:, :4] = p[:, 0:4] & 63
    mn[:, :4] = p[:, 4:8] & 63
    sc[:, 4:] = (p[:, 8:12] & 0xF) | ((p[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (p[:, 8:12] >> 4) | ((p[:, 4:8] >> 6) << 4)
    return sc, mn


def int4_from_q4_k(raw: np.ndarray, rows: int, cols: int) -> Int4Weights:
    """GGUF Q4_K bytes of a (rows, cols) weight, ``cols`` along the blocks, as exact int4 groups of 32."""
    if cols % Q4_K_BLOCK_WEIGHTS:
        raise ValueError(f"Q4_K rows hold multiples of {Q4_K_BLOCK_WEIGHTS} weights, got {cols}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, Q4_K_BLOCK_BYTES)
    if blocks.shape[0] != rows * cols // Q4_K_BLOCK_WEIGHTS:
        raise ValueError(f"{blocks.shape[0]} Q4_K blocks do not make a ({rows}, {cols}) weight")
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # (B, 1)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = _q4_k_scales_mins(blocks[:, 4:16])
    nibbles = blocks[:, 16:].reshape(-1, 4, 32)  # 4 chunks of 64 weights: low nibbles first, then high
    q = np.stack([nibbles & 0xF, nibbles >> 4], axis=2).reshape(-1, 8, 32)  # (B, sub-block, 32)
    scales = d * sc  # (B, 8)
    zeros = INT4_OFFSET * scales - dmin * mn
    groups = cols // Q4_K_GROUP
    return Int4Weights(
        qweight=torch.from_numpy(np.ascontiguousarray(q.reshape(rows, cols))),
        scales=torch.from_numpy(np.ascontiguousarray(scales.reshape(rows, groups), dtype=np.float32)),
        zeros=torch.from_numpy(np.ascontiguousarray(zeros.reshape(rows, groups), dtype=np.float32)),
        group_size=Q4_K_GROUP,
    )


def concat_int4(parts: list[Int4Weights]) -> Int4Weights:
    """Stack int4 weights along the output dimension (fused q/k/v or gate/up projections)."""
    if len({part.group_size for part in parts}) != 1:
        raise ValueError("cannot fuse int4 weights with different group sizes")
    return Int4Weights(
        torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]),
        torch.cat([p.zeros for p in parts]), parts[0].group_size,
    )
