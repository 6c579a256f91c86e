"""What an audit checks (``AuditConfig``), validated before any model loads; read by the audit
(``audit/run.py``) and its distribution check (``audit/distribution.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.audit.near_tie import MANTISSA_BITS
from specdecode.config import DEFAULT_K, METHODS
from specdecode.errors import InvalidRequestError

DEFAULT_DRAWS = 1500
DEFAULT_SAMPLED_TOKENS = 3  # 3 tokens: a k=2 step exercises acceptance, recovery and the bonus token
DEFAULT_TOP_K = 3  # 3^3 = 27 sequences: enumerable, and most cells keep an expected count >= 5
DEFAULT_ALPHA = 0.001  # a correct sampler fails 1 run in 1,000


@dataclass(slots=True)
class AuditConfig:
    methods: tuple[str, ...]
    max_new_tokens: int = 64
    draws: int = DEFAULT_DRAWS
    sampled_tokens: int = DEFAULT_SAMPLED_TOKENS
    top_k: int = DEFAULT_TOP_K
    k: int = DEFAULT_K  # tokens drafted per step; the engine caps it at sampled_tokens - 1 when sampling
    seed: int = 0
    alpha: float = DEFAULT_ALPHA
    precision: str = "fp32"  # fp32, bf16 or fp16: what the near-tie threshold scales with
    near_tie: float | None = None  # a fixed threshold instead of the per-precision rule

    def __post_init__(self) -> None:
        if not self.methods:
            raise InvalidRequestError("Give at least one method to audit (methods=, e.g. draft and ngram).")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise InvalidRequestError(f"Unknown method {unknown[0]!r}; choose from: {', '.join(METHODS)}.")
        for name, value, least in (("draws", self.draws, 1), ("max_new_tokens", self.max_new_tokens, 1),
                                   ("sampled_tokens", self.sampled_tokens, 1), ("top_k", self.top_k, 2),
                                   ("k", self.k, 1)):
            if value < least:
                raise InvalidRequestError(f"{name}={value}: it must be >= {least}.")
        if not 0.0 < self.alpha < 1.0:
            raise InvalidRequestError(f"alpha={self.alpha} is out of range: use (0, 1).")
        if self.precision not in MANTISSA_BITS:
            raise InvalidRequestError(f"precision={self.precision!r} is not one of: {', '.join(MANTISSA_BITS)}.")
        if self.near_tie is not None and self.near_tie < 0:
            raise InvalidRequestError(f"near_tie={self.near_tie}: it must be >= 0.")
