"""Swap a loaded model's projections for weight-only quantized ones.

Every ``Linear`` (q/k/v, o, gate/up, down and the LM head) is quantized; the embedding table
stays in the model dtype because a token reads one row of it, not the whole matrix. With a
tied LM head this means the head becomes a quantized copy while the embedding keeps its own.

int4 takes a GGUF's own Q4_K blocks when the model came from a GGUF and every checkpoint
tensor behind a projection is Q4_K (group 32): those weights are then exactly what the file
holds. Anything else (Q6_K, Q8_0, F16 tensors, HF folders) is requantized from the loaded
weight with ``group_size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import nn

from specdecode.config import QUANTS
from specdecode.errors import InvalidRequestError
from specdecode.quant.formats import Q4_K_GROUP, Int4Weights, concat_int4, int4_from_q4_k, quantize_int4, quantize_int8
from specdecode.quant.linear import Int4Linear, Int8Linear

QUANT_CHOICES = QUANTS
INT4_GROUP_SIZES = (32, 64, 128, 256)
DEFAULT_INT4_GROUP = Q4_K_GROUP  # matches Q4_K, so a Q4_K_M GGUF loads without requantizing


@dataclass(slots=True)
class QuantSummary:
    mode: str
    layers: int = 0  # projections replaced
    from_gguf: int = 0  # of those, int4 layers taken exactly from the GGUF's Q4_K blocks

    def describe(self) -> str:
        exact = f", {self.from_gguf} exactly from the GGUF's Q4_K blocks" if self.from_gguf else ""
        return f"{self.mode}: {self.layers} projections{exact}"


def check_quant(mode: str, param: str = "quant") -> str:
    if mode not in QUANT_CHOICES:
        raise InvalidRequestError(f"{param}={mode!r} is not one of: {', '.join(QUANT_CHOICES)}.")
    return mode


def quantize_model(
    model: nn.Module, mode: str, gguf_path: Path | None = None, group_size: int = DEFAULT_INT4_GROUP
) -> QuantSummary:
    """Replace ``model``'s dense projections in place; call before CPU prepacking."""
    from specdecode.models.layers import Linear
    from specdecode.models.llama import component_names

    check_quant(mode)
    summary = QuantSummary(mode)
    if mode == "none":
        return summary
    if group_size not in INT4_GROUP_SIZES:
        raise InvalidRequestError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}.")
    stored = {}
    if mode == "int4" and gguf_path is not None and group_size == Q4_K_GROUP:
        from specdecode.models.gguf_loader import stored_weights

        stored = stored_weights(gguf_path)
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, Linear)]
    for name, module in targets:
        if module.weight is None:
            raise RuntimeError(f"{name} is already prepacked; quantize before packing")
        weight, bias = module.weight.detach(), module.bias
        if mode == "int8":
            replacement: nn.Module = Int8Linear(quantize_int8(weight), bias)
        else:
            exact = _int4_from_stored(stored, component_names(f"{name}.weight") or (f"{name}.weight",))
            summary.from_gguf += exact is not None
            int4 = exact if exact is not None else quantize_int4(weight, group_size)
            replacement = Int4Linear(int4, bias, weight.dtype, weight.device)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, replacement)
        summary.layers += 1
    return summary


def _int4_from_stored(stored: dict, parts: tuple[str, ...]) -> Int4Weights | None:
    sources = [stored.get(part) for part in parts]
    if not sources or any(s is None or s.type_name != "Q4_K" for s in sources):
        return None
    weights = []
    for source in sources:
        rows, cols = source.shape
        int4 = int4_from_q4_k(source.raw, rows, cols)
        if source.unpermute_heads is not None:
            from specdecode.models.gguf_loader import unpermute_rotary_rows

            int4 = Int4Weights(
                *(unpermute_rotary_rows(t, source.unpermute_heads) for t in (int4.qweight, int4.scales, int4.zeros)),
                int4.group_size,
            )
        weights.append(int4)
    return concat_int4(weights)
