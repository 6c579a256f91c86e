"""Weight-only quantized linear layers: int8 per channel and int4 in groups.

Inputs and outputs stay in the model dtype; only the stored weights are quantized, so the
layer reads 1/2 (int8) or about 1/4 (int4) of a bf16 layer's bytes per token.

Kernel choice, by device and number of rows (tokens) in the call:
- int8 on CPU: the native kernel (``native.py``, blocks of up to 8 rows) when it built, else
  torch's ``_weight_int8pack_mm`` (input sizes that are multiples of 16 only).
- int4 on CPU: torch's ``_weight_int4pack_mm_for_cpu`` on a weight packed once at load.
- other devices: dequantize per call and use the dense matmul. Correct everywhere, but it
  reads the dequantized weight too, so it is not faster than the dense model there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.quant import native
from specdecode.quant.formats import Int4Weights, Int8Weights, dequantize_int4

INT4_INNER_K_TILES = 1
# torch 2.13's CPU _weight_int8pack_mm reads past the row for other input sizes (it crashed
# the process for K = 100 here), so those take the dequantizing path.
ATEN_INT8_K_MULTIPLE = 16  # unused by the CPU packer beyond validation, kept at its documented value


class Int8Linear(nn.Module):
    """y = (x @ q.T) * scale + bias, q int8 (N, K), scale fp32 (N,)."""

    def __init__(self, weights: Int8Weights, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weights.qweight.shape
        self.register_buffer("qweight", weights.qweight.contiguous())
        self.register_buffer("scales", weights.scales.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., K)
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        on_cpu = flat.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32)
        if on_cpu and native.available():
            # Prefill goes through in blocks of MAX_ROWS too: for 150 rows of the 1.5B's
            # gate/up projection that took 55 ms, against 62 ms for torch's int8 kernel, 112 ms
            # for dequantize-then-matmul and 44 ms for the same matmul on a bf16 weight.
            flat = flat.contiguous()
            blocks = [
                native.int8_gemm(flat[start : start + native.MAX_ROWS], self.qweight, self.scales, self.bias)
                for start in range(0, rows, native.MAX_ROWS)
            ]
            out = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
            return out.view(*x.shape[:-1], self.out_features)
        if on_cpu and self.in_features % ATEN_INT8_K_MULTIPLE == 0:
            out = torch.ops.aten._weight_int8pack_mm(flat.contiguous(), self.qweight, self.scales.to(x.dtype))
        else:
            weight = (self.qweight.to(x.dtype) * self.scales[:, None].to(x.dtype))
            out = F.linear(flat, weight)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel"


class Int4Linear(nn.Module):
    """y = x @ W.T + bias with W stored as 4-bit groups: (q - 8) * scale + zero."""

    def __init__(self, weights: Int4Weights, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.out_features, self.in_features = weights.qweight.shape
        self.group_size = weights.group_size
        self.packed = torch.device(device).type == "cpu"
        if self.packed:
            qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                weights.qweight.to(torch.int32).contiguous(), INT4_INNER_K_TILES
            )
            # (K / group, N, 2): the layout torch's int4 kernels read scales and zeros in.
            scales_zeros = torch.stack([weights.scales.T, weights.zeros.T], dim=-1).to(dtype).contiguous()
        else:
            qweight = weights.qweight.to(device)
            scales_zeros = torch.stack([weights.scales, weights.zeros], dim=-1).to(device=device, dtype=dtype)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales_zeros", scales_zeros)
        self.register_buffer("bias", None if bias is None else bias.to(device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., K)
        flat = x.reshape(-1, self.in_features)
        if self.packed and flat.device.type == "cpu":
            sz = self.scales_zeros if self.scales_zeros.dtype == x.dtype else self.scales_zeros.to(x.dtype)
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.contiguous(), self.qweight, self.group_size, sz)
        else:
            weights = Int4Weights(self.qweight, self.scales_zeros[..., 0].float(), self.scales_zeros[..., 1].float(), self.group_size)
            out = F.linear(flat, dequantize_int4(weights).to(x.dtype))
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {self.group_size}"
