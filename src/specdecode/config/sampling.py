"""How a request picks its tokens: ``SamplingParams`` and the structured output it may be held to."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from typing import Any

from specdecode.errors import InvalidRequestError

MIN_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
LOGPROBS_MODES = ("raw", "processed")
# The most samples of one prompt a request may ask for (n). OpenAI allows 128; each sample is a
# row of every pass, so on a small machine a larger n is many requests' work in one.
MAX_CHOICES = 16
SEED_MODULUS = 2**64  # torch.Generator.manual_seed takes 64-bit seeds


@dataclass(slots=True, frozen=True)
class StructuredOutput:
    """A constraint on what a request may generate: exactly one of a JSON schema, any JSON
    object, a regular expression, a list of choices, a grammar in xgrammar's EBNF (the GBNF
    dialect llama.cpp users write), or an xgrammar structural tag (JSON; the server's tool calls
    use one: fixed markup around a JSON schema). Compiled by ``engine/grammar.py``; exact under
    every method.

    ``any_whitespace`` lets JSON hold any whitespace between tokens (the model's own layout; off:
    compact separators only); ``strict`` refuses properties a schema does not list unless it says
    ``additionalProperties`` (OpenAI's strict mode); it applies to ``json_schema`` only.
    """

    json_schema: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None
    any_whitespace: bool = True
    strict: bool = True

    def __post_init__(self) -> None:
        given = [name for name in STRUCTURED_KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                f"A structured output takes exactly one of {', '.join(STRUCTURED_KINDS)}; got "
                f"{', '.join(given) if given else 'none'}."
            )
        for name in ("json_object", "any_whitespace", "strict"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be true or false, got {type(getattr(self, name)).__name__}.")
        if self.choice is not None:
            if (
                not isinstance(self.choice, list | tuple)
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise InvalidRequestError("choice must be a non-empty list of non-empty strings.")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("json_schema", "structural_tag"):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as err:
                    raise InvalidRequestError(f"{name} is not valid JSON: {err}.") from err
                object.__setattr__(self, name, value)
            if value is not None and not isinstance(value, dict):
                raise InvalidRequestError(f"{name} must be a JSON object, got {type(value).__name__}.")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{name} must be a non-empty string.")
        document = self.json_schema if self.json_schema is not None else self.structural_tag
        size = (
            len(json.dumps(document))
            if document is not None
            else len(self.regex or self.grammar or "".join(self.choice or ()))
        )
        if size > MAX_STRUCTURED_CHARS:
            raise InvalidRequestError(
                f"The {self.kind} is {size} characters; at most {MAX_STRUCTURED_CHARS} are taken."
            )
        # Compile time grows faster than linearly with a repetition count (a 3,000-fold pattern
        # took 0.7 s on a 2-core CPU, 50,000 minutes): bound the counts a request may write.
        for text in _patterns(self):
            for match in re.finditer(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}", text):
                if max(int(n) for n in match.groups() if n) > MAX_REPETITION:
                    raise InvalidRequestError(
                        f"The repetition {match.group(0)} in the {self.kind} exceeds "
                        f"{MAX_REPETITION}; write a smaller count."
                    )

    @property
    def kind(self) -> str:
        """Which constraint this is, in words for messages."""
        return {
            "json_schema": "JSON schema",
            "json_object": "JSON grammar",
            "regex": "regex",
            "choice": "choice list",
            "grammar": "grammar",
            "structural_tag": "structural tag",
        }[next(name for name in STRUCTURED_KINDS if getattr(self, name) not in (None, False))]


STRUCTURED_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_STRUCTURED_CHARS = 65536
MAX_REPETITION = 1000


def _patterns(spec: StructuredOutput) -> list[str]:
    """The texts of a spec that may hold regex repetitions: its regex or grammar, or every
    ``pattern`` string in its JSON schema."""
    if spec.regex is not None or spec.grammar is not None:
        return [spec.regex or spec.grammar or ""]
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "pattern" and isinstance(value, str):
                    found.append(value)
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(spec.json_schema if spec.json_schema is not None else spec.structural_tag)
    return found


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy (top-k/top-p are then ignored)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0
    max_new_tokens: int = 128
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # Constrain the output to a JSON schema, a regex, choices or a grammar (engine/grammar.py).
    structured: StructuredOutput | None = None
    # Penalties and bias (engine/penalties.py; OpenAI's and vLLM's meanings): presence and
    # frequency count generated tokens, repetition (1 = off) covers prompt and generated tokens.
    presence_penalty: float = 0.0  # -2..2
    frequency_penalty: float = 0.0  # -2..2
    repetition_penalty: float = 1.0  # > 0
    logit_bias: dict[int, float] | None = None  # token id -> -100..100, added to its logit
    min_p: float = 0.0  # drop tokens below min_p times the most likely one's probability (0 = off)
    # Log-probabilities of each generated token and of the `logprobs` most likely ones (0: the
    # chosen token's only; None: none); "raw": the model's own distribution, "processed": the
    # one sampled from (after the grammar, bias, penalties, temperature, top-k/top-p/min-p).
    logprobs: int | None = None
    logprobs_mode: str = "raw"

    def __post_init__(self) -> None:
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise InvalidRequestError("structured must be a StructuredOutput (specdecode.config).")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}.")
        if self.temperature < MIN_TEMPERATURE:
            # Dividing logits by a temperature this small overflows float32 to inf (NaN
            # probabilities); the distribution is the argmax anyway, so decode greedily.
            self.temperature = 0.0
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k}.")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(s for s in self.stop if s)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}.")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidRequestError(f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}.")
        if not (math.isfinite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.logit_bias is not None:
            bias: dict[int, float] = {}
            for token, value in dict(self.logit_bias).items():
                if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                    raise InvalidRequestError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}.")
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                    raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {value!r} for {token}.")
                bias[token] = float(value)
            self.logit_bias = bias or None
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}.")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise InvalidRequestError(
                f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}."
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of sample ``index`` of n samples of one prompt: its seed is ``seed +
        index`` (vLLM's rule), so sample 0 is the request with n = 1 and each sample can be
        reproduced alone; without a seed each sample draws its own."""
        if index == 0 or self.seed is None:
            return self
        return replace(self, seed=(self.seed + index) % SEED_MODULUS)
