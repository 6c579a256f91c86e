"""The bench's lineup: the models a ``BenchConfig`` needs, loaded once, and its methods built on
them (ours on torch and their quantized variants, transformers' peers, the llama.cpp side), with
the weight bytes each method's passes read for the roofline.

The default "every method" leaves out what this target cannot run (layer skip with no tuned
layers, heads nobody trained) and says so on stderr.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from specdecode.backends.select import llamacpp_installed
from specdecode.bench.config import DEFAULT_METHODS, BenchConfig
from specdecode.bench.llamacpp_bin import LlamaCppBinaryMethod
from specdecode.bench.llamacpp_peers import LlamaCppPyMethod, LlamaCppSide, load_llamacpp_side
from specdecode.bench.methods import (
    HF_METHODS,
    LLAMACPP_BIN_METHODS,
    LLAMACPP_PY_METHODS,
    BenchMethod,
    HFMethod,
    MethodLabel,
    SpecDecodeMethod,
    parse_method,
    uses_draft_model,
)
from specdecode.bench.roofline import weight_bytes_per_forward
from specdecode.errors import InvalidRequestError


def _layerskip_configured(config: BenchConfig) -> bool:
    from specdecode.drafters.layer_skip_file import builtin_choice
    from specdecode.models import demo

    decoder = config.decoder
    return bool(decoder.skip_layers or decoder.layerskip_config or builtin_choice(decoder.target or demo.DEFAULT_TARGET))


class BenchLineup:
    """The methods a ``BenchConfig`` names, ready to run, and the weight bytes each reads."""

    def __init__(self, config: BenchConfig) -> None:
        if config.methods == DEFAULT_METHODS and not _layerskip_configured(config):
            # The default "every method" cannot include layer skip for a target nobody tuned it for.
            config = replace(config, methods=tuple(m for m in config.methods if m != "layerskip"))
            if not config.quiet:
                print("bench: layerskip left out (no --skip-layers or --layerskip-config for this target)", file=sys.stderr)
        heads_given = {"medusa": config.medusa_heads, "eagle": config.eagle_heads}
        if config.methods == DEFAULT_METHODS:
            untrained = [m for m, folder in heads_given.items() if folder is None]
            config = replace(config, methods=tuple(m for m in config.methods if m not in untrained))
            if untrained and not config.quiet:
                print(f"bench: {', '.join(untrained)} left out (no --{untrained[0]}-heads given)", file=sys.stderr)
        for name in config.methods:
            base = parse_method(name).base
            if base in heads_given and heads_given[base] is None:
                raise InvalidRequestError(
                    f"Method {name} needs trained heads: pass {base}_heads=FOLDER (from `specdecode train {base}`)."
                )
        self.config = config
        labels = {name: parse_method(name) for name in config.methods}
        self.heads: dict[str, Any] = {}
        self.compile_logs: list[Any] = []
        # The torch models load only for methods that run on torch: a run of llama.cpp methods
        # alone reads the GGUF files and nothing else (the demo target in bf16 is 3 GiB more),
        # unless only llama.cpp's binaries run and the binding is missing (then the torch target's
        # tokenizer encodes their prompts, as before).
        torch_labels = {name: label for name, label in labels.items() if not label.on_llamacpp}
        uses_torch = bool(torch_labels) or not llamacpp_installed()
        self._decoders: dict[tuple[str, str, bool], Any] = {}
        if uses_torch:
            self._load_torch(torch_labels, heads_given)
        self.llamacpp = self._load_llamacpp_side({n: label for n, label in labels.items() if label.on_llamacpp},
                                                 self.decoder if uses_torch else None)
        if not uses_torch:  # the llama.cpp side's decoder encodes the prompts and names the models
            assert self.llamacpp is not None and self.llamacpp.decoder is not None
            import torch

            from specdecode.core.device import resolve_dtype

            self.decoder = self.llamacpp.decoder
            self.device = torch.device("cpu")
            self.dtype = resolve_dtype(config.decoder.dtype, self.device)
        self.tokenizer = self.decoder.tokenizer
        self.chat = bool(getattr(self.tokenizer, "chat_template", None)) if config.chat is None else config.chat
        self.methods: dict[str, BenchMethod] = {}
        hf_target = hf_draft = None
        if any(m in HF_METHODS for m in config.methods):
            hf_target = self._load_hf(self.decoder.target.folder)
            if "hf-assisted" in config.methods:
                hf_draft = self._load_hf(self.decoder.draft.folder)
        for name in config.methods:
            if name in HF_METHODS:
                self.methods[name] = HFMethod(name, hf_target, self.tokenizer, list(self.decoder.eos_token_ids), hf_draft, config.hf_lookup_tokens)
            elif labels[name].on_llamacpp:
                self.methods[name] = self._llamacpp_method(name)
            else:
                label = labels[name]
                decoder = self._decoder_for(label.target_quant, label.draft_quant, uses_draft_model(label.base) and self.decoder.draft is not None)
                self.methods[name] = SpecDecodeMethod(name, decoder, config.decoder.k)
        if uses_torch:
            self._torch_weight_bytes(labels)
        else:  # llama.cpp reads the GGUF files' own (quantized) bytes
            assert self.llamacpp is not None
            self.target_bytes, self.draft_bytes = self.llamacpp.target_bytes, self.llamacpp.draft_bytes
            self.weight_bytes = {}
        if self.llamacpp is not None:
            side = self.llamacpp
            for name, label in labels.items():
                if label.on_llamacpp:
                    self.weight_bytes[name] = (side.target_bytes, side.draft_bytes if uses_draft_model(label.base) else 0)
        self.weight_bytes = {name: self.weight_bytes[name] for name in config.methods}  # run order

    def _load_torch(self, labels: dict[str, MethodLabel], heads_given: dict[str, str | None]) -> None:
        """Load the torch decoder (``self.decoder``) for the methods in ``labels`` and the heads
        they name; the quantized variants load on first use (``_decoder_for``)."""
        from specdecode.api import SpecDecoder
        from specdecode.drafters.layer_skip_file import resolve_skip_layers
        from specdecode.models.heads import load_heads

        config = self.config
        # The torch decoder loads a draft model only for torch methods; llama.cpp's side has its own.
        needs_draft = any(uses_draft_model(name) for name in labels)
        shared = config.decoder  # every method's settings but what its label sets
        self.decoder = SpecDecoder.from_config(
            replace(shared, method="draft" if needs_draft else "none", backend="torch"), show_progress=not config.quiet,
        )
        if any(label.base == "layerskip" for label in labels.values()) and not self.decoder.config.skip_layers:
            # No layers given: the target's built-in tuned choice (the demo target has one).
            target = self.decoder.target
            skip = resolve_skip_layers(target.name, target.config.num_layers, None, None)
            self.decoder = SpecDecoder(target, self.decoder.draft, replace(self.decoder.config, skip_layers=skip))
        self.heads = {
            kind: load_heads(folder, self.decoder.target.model.dtype, self.decoder.target.model.device)
            for kind, folder in heads_given.items()
            if folder is not None and any(label.base == kind for label in labels.values())
        }
        for heads in self.heads.values():
            self.decoder.attach_heads(heads, shared.tree_size)
        self.device = self.decoder.target.model.device
        self.dtype = self.decoder.target.model.dtype
        # Quantized variants share one loaded model per (role, quantization) and get a decoder
        # per (target quant, draft quant) pair.
        self._loaded = {("target", "none"): self.decoder.target, ("draft", "none"): self.decoder.draft}
        self._decoders = {("none", "none", self.decoder.draft is not None): self.decoder}

    def _model(self, role: str, quant: str) -> Any:
        """The torch target or draft with ``quant`` weights, loaded once."""
        if (role, quant) not in self._loaded:
            from specdecode.models.loader import load_model

            source = self.decoder.target if role == "target" else self.decoder.draft
            self._loaded[role, quant] = load_model(source.name, source.model.dtype, source.model.device,
                                                   not self.config.quiet, quant)
        return self._loaded[role, quant]

    def _decoder_for(self, target_quant: str, draft_quant: str, with_draft: bool) -> Any:
        """The torch decoder over the target and draft of these quantizations, made once."""
        from specdecode.api import SpecDecoder

        key = (target_quant, draft_quant if with_draft else "none", with_draft)
        if key not in self._decoders:
            draft = self._model("draft", key[1]) if with_draft else None
            decoder_config = self.decoder.config if with_draft else replace(self.decoder.config, method="none")
            self._decoders[key] = SpecDecoder(self._model("target", key[0]), draft, decoder_config)
            for heads in self.heads.values():  # trained on the unquantized target's features
                self._decoders[key].attach_heads(heads, self.config.decoder.tree_size)
        return self._decoders[key]

    def _torch_weight_bytes(self, labels: dict[str, MethodLabel]) -> None:
        """Compile every torch decoder (``--compile``), and the weight bytes its methods read."""
        config, draft = self.config, self.decoder.draft
        # Compiled before measuring: every shape a method may run, so none compiles mid-run (a
        # decoder made for plain decoding only needs its one-row pass).
        self.compile_logs = [d.warm_up(not config.quiet, all_shapes=d.config.method != "none")
                             for d in self._decoders.values()] if config.decoder.compile else []
        self.target_bytes = weight_bytes_per_forward(self.decoder.target.config, self.dtype)
        self.draft_bytes = weight_bytes_per_forward(draft.config, self.dtype) if draft is not None else 0
        # (target, draft) bytes per forward pass of each method, as its weights are stored.
        self.weight_bytes = {
            name: (
                weight_bytes_per_forward(self.decoder.target.config, self.dtype, label.target_quant),
                self._draft_bytes(label, draft),
            )
            for name, label in labels.items()
            if not label.on_llamacpp
        }

    def _load_llamacpp_side(self, labels: dict[str, MethodLabel], torch_decoder: Any) -> LlamaCppSide | None:
        """The llama.cpp side (GGUF files, our decoder there) when any label asks for it; beside
        ``torch_decoder`` (None: no torch method runs) its context is the torch target's."""
        if not labels:
            return None
        from specdecode.backends.llamacpp_sequence import DEFAULT_CONTEXT

        return load_llamacpp_side(
            self.config.decoder, labels, show_progress=not self.config.quiet,
            # Our backend's context, capped at what the model was trained for (None: the side's
            # own decoder reads it from the GGUF file, and is loaded to encode the prompts).
            context=None if torch_decoder is None else min(DEFAULT_CONTEXT, torch_decoder.target.config.max_position_embeddings),
        )

    def _llamacpp_method(self, name: str) -> BenchMethod:
        side, config = self.llamacpp, self.config
        assert side is not None
        eos = list(self.decoder.eos_token_ids)
        if name in LLAMACPP_PY_METHODS:
            return LlamaCppPyMethod(name, side.files.target, self.tokenizer, eos, exact=side.exact, context=side.context,
                                    lookup_tokens=config.llamacpp_lookup_tokens)
        if name in LLAMACPP_BIN_METHODS:
            assert config.llamacpp_bin is not None  # BenchConfig checked it
            return LlamaCppBinaryMethod(name, Path(config.llamacpp_bin), side.files.target, side.files.draft, self.tokenizer, eos,
                                        threads=side.threads, context=side.context, exact=side.exact, k=config.decoder.k,
                                        timeout=config.llamacpp_bin_timeout)
        return SpecDecodeMethod(name, side.decoder, config.decoder.k)

    def _draft_bytes(self, label: MethodLabel, draft: Any) -> int:
        """Weight bytes one draft pass of the method reads, as stored."""
        if label.base == "layerskip":  # the target's own weights, minus the skipped layers
            target = self.decoder.target.config
            kept = replace(target, num_layers=target.num_layers - len(self.decoder.config.skip_layers))
            return weight_bytes_per_forward(kept, self.dtype, label.target_quant)
        if label.base in self.heads:  # every head weight (the reduced LM head included)
            return sum(p.numel() * p.element_size() for p in self.heads[label.base].parameters())
        if draft is None or not uses_draft_model(label.base):
            return 0
        return weight_bytes_per_forward(draft.config, self.dtype, label.draft_quant)

    def _load_hf(self, folder: Path) -> Any:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(folder, dtype=self.dtype).to(self.device).eval()
