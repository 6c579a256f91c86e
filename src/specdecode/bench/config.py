"""What ``specdecode bench`` runs: ``BenchConfig``, validated before any model loads.

A run's decoder settings (the models, how they run, how they draft) are one ``DecoderConfig``,
validated there and shared by every method; each method's label sets what differs between
methods (``draft:3@int8``, ``ngram:auto@llama.cpp``, ``none+nocache``). The rest is bench's
own: the methods, prompts, sampling, repeats, the peers' settings and the output.
"""

from __future__ import annotations

import difflib
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from specdecode.bench.llamacpp_bin import DEFAULT_BIN_TIMEOUT_SECONDS
from specdecode.bench.methods import (
    DEFAULT_HF_LOOKUP_TOKENS,
    DEFAULT_LLAMACPP_LOOKUP_TOKENS,
    LLAMACPP_BIN_METHODS,
    PLAIN_LLAMACPP_METHOD,
    PLAIN_METHOD,
    available_methods,
    default_methods,
    parse_method,
)
from specdecode.bench.roofline import DEFAULT_PROBE_BYTES
from specdecode.config import DecoderConfig, SamplingParams
from specdecode.errors import InvalidRequestError

DEFAULT_METHODS = default_methods()  # every specdecode method, then the transformers peers

# Decoder fields that each method's label sets, or bench's own per-method fields (medusa_heads,
# eagle_heads, since a run may hold both): a run-wide value would be overridden, so none is taken.
SET_PER_METHOD: dict[str, str] = {
    "method": "the methods list names them",
    "k_policy": "a label sets it: ngram:auto, draft:threshold",
    "backend": "a label sets it: none@llama.cpp",
    "target_quant": "a label sets it: none@int8",
    "draft_quant": "a label sets it: draft@int8/int4",
    "heads": "bench takes medusa_heads and eagle_heads",
    "prefix_cache": "a label turns it off: none+nocache",
}


@dataclass(slots=True, init=False)
class BenchConfig:
    """A bench run. ``decoder`` holds the decoder settings every method shares; bench's own
    fields follow it.

    Built as ``BenchConfig(decoder=DecoderConfig(...), methods=...)``, or with the decoder's
    fields as keywords beside bench's (``BenchConfig(target=..., k=3, dtype="fp32",
    methods=...)``): each keyword that names a ``DecoderConfig`` field goes into ``decoder``
    (None keeps its default), so a new decoder option reaches bench unlisted. An unknown name is
    an error that names the closest one.
    """

    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    methods: tuple[str, ...] = DEFAULT_METHODS
    prompts: tuple[str, ...] = ("default",)
    categories: tuple[str, ...] = ("all",)
    max_prompts_per_category: int | None = 3
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = 0
    # Trained heads (``specdecode train``) for the medusa and eagle methods (decoder.tree_size: their trees).
    medusa_heads: str | None = None
    eagle_heads: str | None = None
    hf_lookup_tokens: int = DEFAULT_HF_LOOKUP_TOKENS
    llamacpp_lookup_tokens: int = DEFAULT_LLAMACPP_LOOKUP_TOKENS  # num_pred_tokens of llamacpp-lookup
    llamacpp_bin: str | None = None  # folder of llama.cpp's binaries, for llamacpp-bin-*
    llamacpp_bin_timeout: float = DEFAULT_BIN_TIMEOUT_SECONDS  # per turn
    repeats: int = 1
    warmup: bool = True
    chat: bool | None = None  # None: use the chat template when the tokenizer has one
    bandwidth_probe_bytes: int = DEFAULT_PROBE_BYTES  # 0 skips the probe (and the ceilings)
    # The oracle ceiling (bench/oracle.py, oracle_report.py): each method's passes traced, priced with the
    # measured pass costs beside the hindsight-best schedule of the same drafters; greedy, with plain decoding.
    oracle: bool = False
    out: Path = Path("results")
    plots: bool = True
    quiet: bool = False

    def __init__(self, decoder: DecoderConfig | None = None, **options: Any) -> None:
        own = [f for f in fields(BenchConfig) if f.name != "decoder"]
        shared = {f.name for f in fields(DecoderConfig)}
        for name in options:
            if name not in shared and not any(f.name == name for f in own):
                names = [f.name for f in own] + sorted(shared)
                close = difflib.get_close_matches(name, names, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else f" Options: {', '.join(names)}."
                raise InvalidRequestError(f"Unknown bench option {name!r}.{hint}")
        if decoder is not None and not isinstance(decoder, DecoderConfig):
            raise InvalidRequestError(f"decoder must be a DecoderConfig, got {type(decoder).__name__}.")
        # Validated by DecoderConfig, once, whichever way its fields came.
        decoder_options = {name: value for name, value in options.items() if name in shared and value is not None}
        self.decoder = replace(decoder or DecoderConfig(), **decoder_options)
        for f in own:
            default = f.default_factory() if f.default is MISSING else f.default
            setattr(self, f.name, options.get(f.name, default))
        self._validate()

    def _validate(self) -> None:
        self._check_decoder()
        if not self.methods:
            raise InvalidRequestError(f"No methods given; choose from: {', '.join(available_methods())}.")
        for method in self.methods:
            parse_method(method)  # raises a clear error for unknown methods or quantizations
        if len(set(self.methods)) != len(self.methods):
            raise InvalidRequestError("Each method may be listed once.")
        if self.repeats < 1:
            raise InvalidRequestError(f"repeats={self.repeats}: it must be >= 1.")
        if self.max_prompts_per_category is not None and self.max_prompts_per_category < 1:
            raise InvalidRequestError(f"max_prompts_per_category={self.max_prompts_per_category}: it must be >= 1.")
        if self.hf_lookup_tokens < 1:
            raise InvalidRequestError(f"hf_lookup_tokens={self.hf_lookup_tokens}: it must be >= 1.")
        if self.llamacpp_lookup_tokens < 1:
            raise InvalidRequestError(f"llamacpp_lookup_tokens={self.llamacpp_lookup_tokens}: it must be >= 1.")
        if self.llamacpp_bin_timeout <= 0:
            raise InvalidRequestError(f"llamacpp_bin_timeout={self.llamacpp_bin_timeout}: it must be > 0 seconds.")
        binaries = [m for m in self.methods if m in LLAMACPP_BIN_METHODS]
        if binaries and self.llamacpp_bin is None:
            raise InvalidRequestError(
                f"Methods {', '.join(binaries)} run llama.cpp's own binaries: pass llamacpp_bin=DIR, the folder "
                "`bash scripts/build-llamacpp-tools.sh` (in specdecode's repository) prints (it builds them in about 10 minutes)."
            )
        params = self.sampling()  # validates temperature, top-k, top-p, max_new_tokens
        if self.oracle:
            from specdecode.bench.oracle_report import check_oracle_config

            check_oracle_config(self.methods, params.greedy, (PLAIN_METHOD, PLAIN_LLAMACPP_METHOD))

    def _check_decoder(self) -> None:
        """No run-wide value for what each method sets itself (``SET_PER_METHOD``)."""
        if self.decoder.k_policy not in (None, "fixed"):  # k="auto" or a k_policy given
            raise InvalidRequestError("bench sets a method's k policy in its label: --methods ngram:auto,suffix:auto,auto "
                                      "(methods=(...) from Python); k takes a number only.")
        unset = DecoderConfig()
        for name, why in SET_PER_METHOD.items():
            value = getattr(self.decoder, name)
            if name != "k_policy" and value != getattr(unset, name):
                raise InvalidRequestError(f"{name}={value!r}: bench sets it for each method ({why}); leave it unset.")

    def sampling(self, max_new_tokens: int | None = None) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
            max_new_tokens=max_new_tokens or self.max_new_tokens, seed=self.seed,
        )
