"""A linear layer that can prepack its weight for the CPU's bf16 matmul kernels.

Decoding on a CPU is bound by how fast matmuls stream weights. oneDNN's bf16 matmul reads a
weight faster once it is reordered into its blocked layout: on the demo pair (2-core
AVX-512-BF16 CPU, ``benchmarks/bench_forward.py``) a 1-token forward went from 191 to 138 ms
(1.5B target) and from 71 to 51 ms (0.5B draft), with identical logits. The reordered weight is
an opaque oneDNN tensor, so the dense copy is dropped to keep memory flat. fp32 is slower
packed, and other devices have their own kernels, so only CPU bf16 weights are packed.

Inside ``torch.compile`` the packed matmul goes through ``packed_linear``, a custom op that
inductor calls as it is (its lowering of the oneDNN op expects weights it packed itself, under
``freezing``, which keeps a packed copy of every weight per compiled graph:
``backends/compiled.py``). The compiled passes thus share the one packed copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.core.device import cpu_supports_bf16

# Expected rows per call for oneDNN's reorder heuristics: decoding feeds 1 to ~9 rows.
PACK_BATCH_HINT = 1


@torch.library.custom_op("specdecode::packed_linear", mutates_args=())
def packed_linear(
    x: torch.Tensor,  # (N, in_features)
    packed_weight: torch.Tensor,  # opaque oneDNN weight from pack_for_cpu
    bias: torch.Tensor | None,  # (out_features,)
    out_features: int,
) -> torch.Tensor:  # (N, out_features)
    """The packed matmul as one opaque op, for compiled graphs (eager calls oneDNN directly)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


@packed_linear.register_fake
def _packed_linear_shape(
    x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


class Linear(nn.Linear):
    """``nn.Linear`` plus an optional prepacked CPU weight."""

    packed_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in_features)
        if self.packed_weight is None:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, x.shape[-1])
        if torch.compiler.is_compiling():
            out = packed_linear(flat, self.packed_weight, self.bias, self.out_features)
        else:  # the direct call: eager passes need not pay the custom op's Python dispatch
            out = torch.ops.mkldnn._linear_pointwise(flat, self.packed_weight, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def pack_for_cpu(self) -> bool:
        """Reorder the weight for oneDNN when that is the faster path; True if packed."""
        weight = self.weight
        if weight is None or weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
            return False
        if not cpu_supports_bf16():
            return False
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
        # Drop this module's reference to the dense weight (a tied embedding keeps its own).
        del self.weight
        self.weight = None  # type: ignore[assignment]
        return True
