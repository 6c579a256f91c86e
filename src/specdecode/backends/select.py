"""Which backend runs a model: ``--backend auto|torch|llama.cpp``.

``auto`` takes llama.cpp for GGUF files on a CPU when llama-cpp-python is installed and the
request needs nothing only the torch backend has; torch otherwise. ggml's quantized CPU
kernels read a Q4_K_M file at the memory-bandwidth limit, where our torch passes read bf16
weights (three times the bytes) or run torch's slower int4 kernel, so on a CPU the same GGUF
file decodes several times faster there (docs/design.md, benchmarks/RESULTS.md). Asking for
``llama.cpp`` where it cannot run is an error that names what to change.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from specdecode.backends.base import BACKENDS
from specdecode.errors import InvalidRequestError

LLAMACPP = "llama.cpp"
TORCH = "torch"
# Methods that need the torch model itself: token trees with tree attention and hidden states
# for heads (medusa, eagle), the target run with layers skipped (layerskip).
TORCH_ONLY_METHODS = ("layerskip", "medusa", "eagle")


@dataclass(frozen=True, slots=True)
class BackendChoice:
    name: str  # "torch" or "llama.cpp"
    reason: str  # why, in words, for the one line the CLI prints


def llamacpp_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def choose_backend(
    requested: str,
    *,
    target_is_gguf: bool,
    draft_is_gguf: bool | None,
    device: torch.device,
    method: str,
    weight_quant: bool,
    kv_int8: bool,
    batch_engine: bool = False,
    compiled: bool = False,
) -> BackendChoice:
    """The backend for these models and options. ``draft_is_gguf`` is None without a draft
    model; ``batch_engine`` says the caller needs the continuous-batching engine (the server)."""
    if requested not in BACKENDS:
        raise InvalidRequestError(f"backend must be one of {', '.join(BACKENDS)}, got {requested!r}.")
    if requested == TORCH:
        return BackendChoice(TORCH, "asked for")
    blockers = []
    if not target_is_gguf:
        blockers.append("the target is not a GGUF file")
    if draft_is_gguf is False:
        blockers.append("the draft model is not a GGUF file")
    if device.type != "cpu":
        blockers.append(f"it runs on the CPU only, not {device.type}")
    if method in TORCH_ONLY_METHODS:
        blockers.append(f"method {method} needs the torch model (tree attention, hidden states or skipped layers)")
    if weight_quant:
        blockers.append("target_quant/draft_quant quantize torch weights (a GGUF file carries its own quantization)")
    if kv_int8:
        blockers.append("kv_dtype int8 is the torch backend's cache")
    if compiled:
        blockers.append("compile= compiles the torch backend's passes")
    if batch_engine:
        blockers.append("the continuous-batching engine (batches, the server) runs on torch")
    installed = llamacpp_installed()
    if not installed:
        blockers.append("llama-cpp-python is not installed (pip install llama-cpp-python; it compiles llama.cpp)")
    if requested == LLAMACPP:
        if blockers:
            raise InvalidRequestError(
                f'The llama.cpp backend cannot run this: {"; ".join(blockers)}. Use backend="torch".'
            )
        return BackendChoice(LLAMACPP, "asked for")
    if blockers:
        return BackendChoice(TORCH, blockers[0])
    return BackendChoice(LLAMACPP, "GGUF files on the CPU run on ggml's kernels")
