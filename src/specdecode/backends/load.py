"""Loading a decoder's models by name (``SpecDecoder.from_pretrained``): the backend that runs
them (``backends/select.py``, said in one line on stderr), then the target, the draft model and
the trained heads on it.

A demo target with no draft gets the demo draft. On llama.cpp the models are the GGUF files
themselves (``backends/llamacpp_sequence.py``); on torch they are loaded, and quantized, by
``models/loader.py``, with layer skip's layers resolved from a tuned file where none are given.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from specdecode.backends.device import resolve_device, resolve_dtype
from specdecode.backends.llamacpp_sequence import load_llamacpp_model
from specdecode.backends.select import LLAMACPP, choose_backend
from specdecode.config import DRAFT_MODEL_METHODS, TREE_METHODS, SpecConfig
from specdecode.drafters.layer_skip import resolve_skip_layers
from specdecode.errors import InvalidRequestError
from specdecode.kv.static import check_kv_dtype
from specdecode.models.heads import DraftHeads, load_heads
from specdecode.models.loader import LoadedModel, gguf_source, load_model
from specdecode.quant.apply import check_quant


@dataclass(slots=True)
class LoadedModels:
    """What a ``SpecDecoder`` is built from."""

    target: LoadedModel
    draft: LoadedModel | None
    spec: SpecConfig  # the caller's, with what loading decided (layers to skip, the k policy)
    kv_dtype: str = "auto"
    heads: DraftHeads | None = None


def load_models(
    target: str | None,
    draft: str | None,
    spec: SpecConfig,
    *,
    k_given: bool,  # the caller chose k or a k policy (else llama.cpp gets the cost-aware k)
    skip_layers: Sequence[int] | None,
    layerskip_config: str | Path | None,
    dtype: str,
    device: str,
    target_quant: str,
    draft_quant: str,
    kv_dtype: str,
    heads: str | Path | None,
    backend: str,
    show_progress: bool,
    compile: bool | str = False,
) -> LoadedModels:
    """The models ``spec`` needs, by name, on the backend ``backend`` resolves to."""
    from specdecode.models import demo

    method = spec.method
    if method in TREE_METHODS and heads is None:
        raise InvalidRequestError(
            f'method="{method}" needs trained heads for the target: run `specdecode train {method} '
            f"--target TARGET --data stdlib --out HEADS` and pass heads=HEADS."
        )
    check_quant(target_quant, "target_quant")
    check_quant(draft_quant, "draft_quant")
    check_kv_dtype(kv_dtype)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    if target is None:
        target = demo.DEFAULT_TARGET
    if draft is None and method in DRAFT_MODEL_METHODS:
        if demo.is_demo_model_name(target):
            draft = demo.DEFAULT_DRAFT
        elif method == "draft":
            raise InvalidRequestError(
                'method="draft" needs a draft model: pass draft= (a smaller model with the same '
                'tokenizer), or method="none" for plain decoding.'
            )
    uses_draft = method in DRAFT_MODEL_METHODS and draft is not None
    choice = choose_backend(
        backend, target_is_gguf=gguf_source(target, show_progress) is not None,
        draft_is_gguf=(gguf_source(draft, show_progress) is not None) if uses_draft else None,
        device=torch_device, method=method, weight_quant=(target_quant, draft_quant) != ("none", "none"),
        kv_int8=kv_dtype == "int8", compiled=bool(compile),
    )
    if show_progress:
        print(f"specdecode: backend {choice.name} ({choice.reason})", file=sys.stderr, flush=True)
    if choice.name == LLAMACPP:
        if not k_given:
            # ggml's CPU passes are compute-bound on small machines: a verify row can cost
            # over half a pass, so a fixed k can lose to plain decoding; the cost-aware k
            # drafts only as much as the measured costs and acceptance pay for.
            spec = replace(spec, k_policy="cost")
        exact = torch_dtype == torch.float32
        target_model = load_llamacpp_model(target, exact=exact, show_progress=show_progress)
        draft_model = load_llamacpp_model(draft, exact=exact, show_progress=show_progress) if uses_draft else None
        return LoadedModels(target_model, draft_model, spec)
    target_model = load_model(target, torch_dtype, torch_device, show_progress=show_progress, quant=target_quant)
    if skip_layers or layerskip_config or method == "layerskip":
        chosen = resolve_skip_layers(target, target_model.config.num_layers, skip_layers, layerskip_config)
        spec = replace(spec, skip_layers=chosen)
    draft_model = None
    if uses_draft:
        draft_model = load_model(draft, torch_dtype, torch_device, show_progress=show_progress, quant=draft_quant)
    loaded_heads = None if heads is None else load_heads(heads, torch_dtype, torch_device)
    return LoadedModels(target_model, draft_model, spec, kv_dtype=kv_dtype, heads=loaded_heads)
