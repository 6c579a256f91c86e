"""What ``specdecode bench`` runs: ``BenchConfig``, validated before any model loads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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
from specdecode.config import SamplingParams
from specdecode.errors import InvalidRequestError

DEFAULT_METHODS = default_methods()  # every specdecode method, then the transformers peers


@dataclass(slots=True)
class BenchConfig:
    target: str | None = None
    draft: str | None = None
    methods: tuple[str, ...] = DEFAULT_METHODS
    prompts: tuple[str, ...] = ("default",)
    categories: tuple[str, ...] = ("all",)
    max_prompts_per_category: int | None = 3
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = 0
    k: int | None = None
    draft_confidence: float | None = None
    ngram_max: int | None = None
    ngram_min: int | None = None
    skip_layers: tuple[int, ...] | None = None  # layerskip (default: the demo target's tuned choice)
    layerskip_config: str | None = None
    # Trained heads (``specdecode train``) for the medusa and eagle methods, and their tree size.
    medusa_heads: str | None = None
    eagle_heads: str | None = None
    tree_size: int | None = None
    hf_lookup_tokens: int = DEFAULT_HF_LOOKUP_TOKENS
    llamacpp_lookup_tokens: int = DEFAULT_LLAMACPP_LOOKUP_TOKENS  # num_pred_tokens of llamacpp-lookup
    llamacpp_bin: str | None = None  # folder of llama.cpp's binaries, for llamacpp-bin-*
    llamacpp_bin_timeout: float = DEFAULT_BIN_TIMEOUT_SECONDS  # per turn
    repeats: int = 1
    warmup: bool = True
    chat: bool | None = None  # None: use the chat template when the tokenizer has one
    dtype: str = "auto"
    device: str = "auto"
    kv_dtype: str = "auto"  # KV-cache storage of specdecode's methods: auto or int8
    compile: bool | str = False  # specdecode's torch passes compiled (backends/compiled.py), before the run
    bandwidth_probe_bytes: int = DEFAULT_PROBE_BYTES  # 0 skips the probe (and the ceilings)
    # The oracle ceiling (bench/oracle.py, oracle_report.py): each method's passes traced, priced with the
    # measured pass costs beside the hindsight-best schedule of the same drafters; greedy, with plain decoding.
    oracle: bool = False
    out: Path = Path("results")
    plots: bool = True
    quiet: bool = False

    def __post_init__(self) -> None:
        if not self.methods:
            raise InvalidRequestError(f"No methods given; choose from: {', '.join(available_methods())}.")
        for method in self.methods:
            parse_method(method)  # raises a clear error for unknown methods or quantizations
        from specdecode.kv.static import check_kv_dtype

        check_kv_dtype(self.kv_dtype)
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

    def sampling(self, max_new_tokens: int | None = None) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
            max_new_tokens=max_new_tokens or self.max_new_tokens, seed=self.seed,
        )
