"""Loading the models a ``DecoderConfig`` names (``SpecDecoder.from_pretrained``): the backend that
runs them (``backends/select.py``, said in one line on stderr), then the target, the draft model
and the trained heads on it; returns the config as resolved, not rewritten in place.

A demo target with no draft gets the demo draft. On llama.cpp the models are the GGUF files
themselves (``backends/llamacpp_sequence.py``); on torch they are loaded, and quantized, by
``models/loader.py``, with layer skip's layers resolved from a tuned file where none are given.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

import torch

from specdecode.backends.llamacpp_sequence import load_llamacpp_model
from specdecode.backends.select import LLAMACPP, choose_backend
from specdecode.config import DecoderConfig
from specdecode.core import registry
from specdecode.core.device import resolve_device, resolve_dtype
from specdecode.drafters.layer_skip_file import resolve_skip_layers
from specdecode.errors import InvalidRequestError
from specdecode.models.heads import DraftHeads, load_heads
from specdecode.models.loader import LoadedModel, gguf_source, load_model


@dataclass(slots=True, frozen=True)
class LoadedModels:
    """What a ``SpecDecoder`` is built from: the models, and the config as loading resolved it."""

    target: LoadedModel
    draft: LoadedModel | None
    # The caller's config with what loading decided: the backend, the demo models filled in, the
    # layers layer skip skips and the backend's default k policy.
    config: DecoderConfig
    heads: DraftHeads | None = None


def load_models(config: DecoderConfig, show_progress: bool = True) -> LoadedModels:
    """The models ``config`` names, on the backend its ``backend`` resolves to."""
    from specdecode.models import demo

    method = config.method
    spec = registry.BY_NAME[method]  # DecoderConfig checked the name
    if spec.needs_heads and config.heads is None:
        raise InvalidRequestError(
            f'method="{method}" needs trained heads for the target: run `specdecode train {method} '
            f"--target TARGET --data stdlib --out HEADS` and pass heads=HEADS."
        )
    torch_device = resolve_device(config.device)
    torch_dtype = resolve_dtype(config.dtype, torch_device)
    target = config.target or demo.DEFAULT_TARGET
    draft = config.draft
    if draft is None and spec.uses_draft_model:
        if demo.is_demo_model_name(target):
            draft = demo.DEFAULT_DRAFT
        elif spec.needs == registry.NEEDS_DRAFT_MODEL:
            raise InvalidRequestError(
                f'method="{method}" needs a draft model: pass draft= (a smaller model with the same '
                f'tokenizer), or method="{registry.NONE.name}" for plain decoding.'
            )
    uses_draft = spec.uses_draft_model and draft is not None
    choice = choose_backend(
        config.backend, target_is_gguf=gguf_source(target, show_progress) is not None,
        draft_is_gguf=(gguf_source(draft, show_progress) is not None) if uses_draft else None,
        device=torch_device, method=method, weight_quant=(config.target_quant, config.draft_quant) != ("none", "none"),
        kv_int8=config.kv_dtype == "int8", compiled=bool(config.compile),
    )
    if show_progress:
        print(f"specdecode: backend {choice.name} ({choice.reason})", file=sys.stderr, flush=True)
    resolved = replace(config, target=target, draft=draft if uses_draft else None, backend=choice.name)
    if choice.name == LLAMACPP:
        # ggml's CPU passes are compute-bound on small machines: a verify row can cost over half
        # a pass, so a fixed k can lose to plain decoding; the cost-aware k drafts only as much
        # as the measured costs and acceptance pay for.
        resolved = replace(resolved, k_policy=resolved.k_policy or "cost")
        exact = torch_dtype == torch.float32
        target_model = load_llamacpp_model(target, exact=exact, show_progress=show_progress)
        draft_model = load_llamacpp_model(draft, exact=exact, show_progress=show_progress) if uses_draft else None
        return LoadedModels(target_model, draft_model, resolved)
    target_model = load_model(target, torch_dtype, torch_device, show_progress=show_progress, quant=config.target_quant)
    if config.skip_layers or config.layerskip_config or spec.needs == registry.NEEDS_SKIP_LAYERS:
        chosen = resolve_skip_layers(target, target_model.config.num_layers, config.skip_layers or None,
                                     config.layerskip_config)
        resolved = replace(resolved, skip_layers=chosen)
    draft_model = None
    if uses_draft:
        draft_model = load_model(draft, torch_dtype, torch_device, show_progress=show_progress, quant=config.draft_quant)
    loaded_heads = None if config.heads is None else load_heads(config.heads, torch_dtype, torch_device)
    return LoadedModels(target_model, draft_model, resolved, heads=loaded_heads)
