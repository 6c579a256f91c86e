"""Configuration dataclasses: the model's shape, sampling parameters, speculation settings.

``ModelConfig`` is parsed from a Hugging Face ``config.json`` (GGUF files are first converted
to that form by ``models.gguf_loader``), so there is one source of truth for model shapes.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from dataclasses import dataclass, fields, replace
from typing import Any

from specdecode.core import registry
from specdecode.core.device import DEVICES
from specdecode.errors import InvalidRequestError, UnsupportedModelError

# model_type values whose HF checkpoints map onto our one Llama-family transformer.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "qwen2", "mistral")
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")


@dataclass(slots=True, frozen=True)
class RopeScaling:
    """RoPE frequency scaling as found in ``config.json``'s ``rope_scaling`` (None = plain RoPE)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"RoPE scaling type {self.rope_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}."
            )


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama 2/3, Qwen2/2.5, Mistral)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})."
            )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Parse a Hugging Face ``config.json`` dictionary; raise for unsupported architectures."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = cfg.get("architectures") or [model_type]
            raise UnsupportedModelError(
                f"Unsupported model architecture {archs[0]!r} (model_type={model_type!r}). "
                f"specdecode supports the Llama family: {', '.join(SUPPORTED_MODEL_TYPES)}."
            )
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        # transformers >= 5 writes rope_parameters (type, factors and theta); older configs
        # write rope_scaling plus a top-level rope_theta.
        scaling = cfg.get("rope_parameters") or cfg.get("rope_scaling")
        rope_scaling = None
        if scaling:
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            if rope_type != "default":
                rope_scaling = RopeScaling(
                    rope_type=rope_type,
                    factor=float(scaling.get("factor", 1.0)),
                    low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
                    high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
                    original_max_position_embeddings=int(
                        scaling.get("original_max_position_embeddings", 8192)
                    ),
                )
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None and isinstance(scaling, dict):
            rope_theta = scaling.get("rope_theta")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        # Qwen2 configs carry use_sliding_window=false next to a sliding_window value.
        window = cfg.get("sliding_window")
        if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
            window = None
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; Llama and Mistral say so with attention_bias.
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            rope_scaling=rope_scaling,
            sliding_window=int(window) if window else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


# Temperatures below this are greedy, as in vLLM (_SAMPLING_EPS).
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
            if not isinstance(self.choice, list | tuple) or not self.choice or not all(
                    isinstance(c, str) and c for c in self.choice):
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
        size = len(json.dumps(document)) if document is not None else len(
            self.regex or self.grammar or "".join(self.choice or ()))
        if size > MAX_STRUCTURED_CHARS:
            raise InvalidRequestError(f"The {self.kind} is {size} characters; at most {MAX_STRUCTURED_CHARS} are taken.")
        # Compile time grows faster than linearly with a repetition count (a 3,000-fold pattern
        # took 0.7 s on a 2-core CPU, 50,000 minutes): bound the counts a request may write.
        for text in _patterns(self):
            for match in re.finditer(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}", text):
                if max(int(n) for n in match.groups() if n) > MAX_REPETITION:
                    raise InvalidRequestError(f"The repetition {match.group(0)} in the {self.kind} exceeds "
                                              f"{MAX_REPETITION}; write a smaller count.")

    @property
    def kind(self) -> str:
        """Which constraint this is, in words for messages."""
        return {"json_schema": "JSON schema", "json_object": "JSON grammar", "regex": "regex",
                "choice": "choice list", "grammar": "grammar", "structural_tag": "structural tag"}[next(
                    name for name in STRUCTURED_KINDS if getattr(self, name) not in (None, False))]


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
            raise InvalidRequestError("structured must be a StructuredOutput (config.py).")
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
            raise InvalidRequestError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}.")

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


# The methods are core/registry.py's entries; these are its views, by the names code imports.
METHODS: tuple[str, ...] = registry.METHODS
TREE_METHODS: tuple[str, ...] = registry.HEAD_METHODS  # trained heads draft token trees
# lossless: greedy equality / rejection sampling; typical: Medusa's lossy typical acceptance,
# tree methods only, opt-in.
ACCEPTANCE_RULES: tuple[str, ...] = ("lossless", "typical")
# Methods that use a draft model (auto runs without one too: lookup and plain decoding only).
DRAFT_MODEL_METHODS: tuple[str, ...] = registry.DRAFT_MODEL_METHODS
# Measured on the demo pair (benchmarks/bench_forward.py, a HumanEval run and a 5-prompt sweep):
# the target's bf16 forward over 6 tokens costs 1.5x one token and over 9 tokens 1.8x; k from
# 3 to 6 performed within noise on code prompts. The confidence cut-off of 0.3 stops drafting
# early where the draft is unsure (chat prompts went from 0.63-0.91x to 0.87-0.99x of plain,
# code prompts stayed ~1.6x).
DEFAULT_K = 5
DEFAULT_K_MAX = 8  # the most tokens --k auto drafts per step
MAX_K_MAX = 32
MAX_TREE_SIZE = 256
K_POLICY_CHOICES = ("fixed", "cost", "threshold")
DEFAULT_DRAFT_CONFIDENCE = 0.3
# Prompt lookup tries the last 3 tokens, then 2, then 1 (see drafters/ngram.py).
DEFAULT_NGRAM_MAX = 3
DEFAULT_NGRAM_MIN = 1
# Earlier responses kept for suffix decoding, in tokens over all groups (drafters/suffix_cache.py).
DEFAULT_SUFFIX_CACHE_TOKENS = 1 << 17
# Structured outputs: seconds a grammar may take to compile (in a child process that is killed
# past it: engine/grammar_process.py); the largest schema of the test sets compiles in under 1 s
# on 2 cores. And the bytes of compiled grammars kept for reuse (xgrammar's estimate): about 30
# small tool schemas of the demo's 151k vocabulary (4.3 MiB each), an agent's tool set; 200
# distinct schemas then grew the server by 343 MB with 256 MiB (benchmarks/hostile_requests.py).
DEFAULT_GRAMMAR_TIMEOUT = 10.0
DEFAULT_GRAMMAR_CACHE_BYTES = 128 * 1024 * 1024


# Choices of the loading options, validated here once (each is also the flag's choices).
DTYPES: tuple[str, ...] = ("auto", "bf16", "fp16", "fp32")
BACKEND_CHOICES: tuple[str, ...] = ("auto", "torch", "llama.cpp")
QUANTS: tuple[str, ...] = ("none", "int8", "int4")
KV_DTYPES: tuple[str, ...] = ("auto", "int8")  # auto: the model's dtype
COMPILE_MODES: tuple[str, ...] = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")
ENGINES: tuple[str, ...] = ("single", "batch")


@dataclass(slots=True, frozen=True)
class DecoderConfig:
    """Everything a ``SpecDecoder`` is built from: which models, how they run, how they speculate.

    One config serves every entry point: ``SpecDecoder.from_pretrained(**kwargs)`` builds it from
    keyword arguments (``from_kwargs``: an unknown name is an error that suggests the closest
    one), and every command builds it from one shared group of flags (``cli/args.py:
    add_decoder_arguments``, then ``from_args``). It is validated once, here; loading
    (``specdecode/loading.py``) returns a resolved copy: the backend it chose, the demo models
    it filled in, the layers layer skip skips and, on llama.cpp, the k policy.

    ``k`` is the draft length: the tokens a step drafts under the fixed policy, the first
    length the threshold policy tries, and the cost policy's guess before it has measured
    anything (``draft_k``: ``k``, or ``DEFAULT_K`` where none was given). ``k="auto"`` stands for
    the cost policy (or ``k_policy="threshold"``), and is stored as that policy with ``k`` None.
    ``k_policy``: a given ``k`` alone means ``fixed``; with neither given it stays None, the
    default, which loading resolves to ``cost`` on llama.cpp, whose compute-bound CPU passes
    make a fixed k lose to plain decoding (docs/design.md#backends). Left None (torch), the
    single-request engine drafts a fixed k and the batch engine chooses k for the batch as a
    whole (``cost``, up to k); a policy given is honoured by both (the batch engine gives the
    chain methods' rows of ``fixed`` or ``threshold`` their own k: ``engine/batch_rows.py``).
    """

    target: str | None = None  # a demo name, a .gguf file, an HF folder or hub id (None: the demo target)
    draft: str | None = None  # the draft model (None: the demo draft with a demo target, else none)
    method: str = registry.DRAFT.name
    k: int | str | None = None
    k_policy: str | None = None
    k_max: int = DEFAULT_K_MAX
    # The draft model stops proposing once its probability for a drafted token is below this.
    draft_confidence: float = DEFAULT_DRAFT_CONFIDENCE
    # Prompt lookup (method ngram): the longest and shortest n-gram it matches.
    ngram_max: int = DEFAULT_NGRAM_MAX
    ngram_min: int = DEFAULT_NGRAM_MIN
    # Layer skip: the target's layers its drafts skip (empty: from layerskip_config or the
    # target's tuned file, resolved at load), or the file `specdecode tune-layerskip` writes.
    skip_layers: tuple[int, ...] = ()
    layerskip_config: str | None = None
    # Tree methods: heads from `specdecode train`, drafted nodes per tree (None: the method's
    # default) and the acceptance rule (typical: Medusa's lossy rule, opt-in).
    heads: str | None = None
    tree_size: int | None = None
    acceptance: str = "lossless"
    # Suffix decoding (method suffix, and auto's suffix source): earlier responses kept, in tokens.
    suffix_cache_tokens: int = DEFAULT_SUFFIX_CACHE_TOKENS
    # A request reuses the K/V of the prompt prefix it shares with the previous one (engine/prefix.py).
    prefix_cache: bool = True
    # Structured outputs: draft the text a grammar forces (``{"name": "``) in the tokenizer's own
    # tokens, in place of the drafter's proposal (engine/grammar.py); lossless either way.
    jump_forward: bool = True
    # Bounds on a request's grammar: compile seconds (None: in this thread, with no bound, for
    # trusted specs) and the bytes of compiled grammars kept (engine/grammar.py).
    grammar_timeout: float | None = DEFAULT_GRAMMAR_TIMEOUT
    grammar_cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES
    # Time the passes the cost-aware choices read again instead of reading an earlier run's
    # stored timings for the same model, backend and machine (costs/store.py).
    retime_costs: bool = False
    # Where and how the passes run.
    backend: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    target_quant: str = "none"
    draft_quant: str = "none"
    kv_dtype: str = "auto"
    compile: bool | str = False  # True, or a torch.compile mode (COMPILE_MODES)
    # Which engine generate and stream decode on (ENGINES): the single-request engine, or the batch
    # engine holding one request (engine/one_request.py); the server and generate_batch always batch.
    engine: str = "single"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidRequestError(f"Unknown method {self.method!r}; choose one of: {', '.join(METHODS)}.")
        k, k_policy = resolve_k(self.k, self.k_policy)
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise InvalidRequestError(f"k (tokens drafted per step) must be a positive integer or 'auto', got {k!r}.")
        object.__setattr__(self, "k", k)
        object.__setattr__(self, "k_policy", "fixed" if k is not None and k_policy is None else k_policy)
        if k_policy is not None:
            check_k_policy(k_policy, self.k_max)
        elif not 1 <= self.k_max <= MAX_K_MAX:
            raise InvalidRequestError(f"k_max={self.k_max} is out of range: use 1..{MAX_K_MAX}.")
        if not 0.0 <= self.draft_confidence < 1.0:
            raise InvalidRequestError(f"draft_confidence must be in [0, 1), got {self.draft_confidence}.")
        check_ngram_sizes(self.ngram_max, self.ngram_min)
        check_acceptance(self.acceptance, self.method)
        object.__setattr__(self, "skip_layers", tuple(int(layer) for layer in self.skip_layers or ()))
        if any(layer < 0 for layer in self.skip_layers):
            raise InvalidRequestError(f"skip_layers must be layer indices >= 0, got {list(self.skip_layers)}.")
        if self.tree_size is not None and not 1 <= self.tree_size <= MAX_TREE_SIZE:
            raise InvalidRequestError(f"tree_size={self.tree_size} is out of range: use 1..{MAX_TREE_SIZE}.")
        if self.suffix_cache_tokens < 0:
            raise InvalidRequestError(
                f"suffix_cache_tokens={self.suffix_cache_tokens} is out of range: use >= 0 (0 keeps no earlier responses)."
            )
        if self.grammar_timeout is not None and not self.grammar_timeout > 0:
            raise InvalidRequestError(f"grammar_timeout={self.grammar_timeout} is out of range: use seconds > 0, or "
                                      "None to compile in this thread with no limit.")
        if self.grammar_cache_bytes < 0:
            raise InvalidRequestError(f"grammar_cache_bytes={self.grammar_cache_bytes} is out of range: use >= 0.")
        for name, choices in (("backend", BACKEND_CHOICES), ("dtype", DTYPES), ("target_quant", QUANTS),
                              ("draft_quant", QUANTS), ("kv_dtype", KV_DTYPES)):
            if getattr(self, name) not in choices:
                raise InvalidRequestError(f"{name}={getattr(self, name)!r} is not one of: {', '.join(choices)}.")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise InvalidRequestError(f"device={self.device!r} is not one of: {', '.join(DEVICES)} (or cuda:N).")
        if self.compile is None:
            object.__setattr__(self, "compile", False)
        if not isinstance(self.compile, bool) and self.compile not in COMPILE_MODES:
            raise InvalidRequestError(f"compile must be True, False or one of {', '.join(COMPILE_MODES)}, got {self.compile!r}.")
        check_engine(self.engine, self.kv_dtype, bool(self.compile), self.acceptance)
        for name in ("target", "draft", "heads", "layerskip_config"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                object.__setattr__(self, name, str(value))  # a Path is welcome; stored as text

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> DecoderConfig:
        """A config from keyword arguments (None: the option's default); an unknown name is an
        error that names the closest field."""
        names = [f.name for f in fields(cls)]
        for key in kwargs:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else f" Options: {', '.join(names)}."
                raise InvalidRequestError(f"Unknown decoder option {key!r}.{hint}")
        return cls(**{key: value for key, value in kwargs.items() if value is not None})

    @classmethod
    def from_args(cls, args: Any, **overrides: Any) -> DecoderConfig:
        """A config from parsed flags (``cli/args.py: add_decoder_arguments``): each field whose
        attribute is present and not None, then ``overrides``; absent flags keep the defaults here."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None}
        mode = getattr(args, "compile_mode", None)
        if mode is not None:
            if not values.get("compile"):
                raise InvalidRequestError("compile_mode needs compile.")
            values["compile"] = mode
        return cls(**{**values, **overrides})

    @property
    def draft_k(self) -> int:
        """The draft length in force: ``k``, or ``DEFAULT_K`` where none was given."""
        return self.k if self.k is not None else DEFAULT_K

    @property
    def policy(self) -> str:
        """The k policy in force: ``k_policy``, or ``fixed`` before loading resolved the backend's default."""
        return self.k_policy or "fixed"

    def call_k(self, k: int | str | None, k_policy: str | None) -> tuple[int, str]:
        """(k, policy) for one call that may override ``k`` and ``k_policy``: k is the fixed draft
        length, or the first one a policy tries."""
        if k is None and k_policy is None:
            return self.draft_k, self.policy
        fixed_k, policy = resolve_k(k, k_policy)
        if fixed_k is not None and (isinstance(fixed_k, bool) or fixed_k < 1):
            raise InvalidRequestError(f"k (tokens drafted per step) must be >= 1, got {fixed_k}.")
        call_k = fixed_k if fixed_k is not None else self.draft_k
        if policy is None:
            policy = "fixed" if k is not None else self.policy
        check_k_policy(policy, self.k_max)
        return call_k, policy


def check_engine(engine: str, kv_dtype: str, compile: bool, acceptance: str) -> None:
    """The batch engine runs neither an int8 KV cache, compiled passes nor typical acceptance
    (yet): those stay on the single-request engine."""
    if engine not in ENGINES:
        raise InvalidRequestError(f"engine={engine!r} is not one of: {', '.join(ENGINES)}.")
    if engine != "batch":
        return
    for given, name in ((kv_dtype != "auto", 'kv_dtype="int8"'), (compile, "compile"),
                        (acceptance != "lossless", 'acceptance="typical"')):
        if given:
            raise InvalidRequestError(f'{name} runs on the single-request engine only: drop it or use engine="single".')


def check_acceptance(acceptance: str, method: str) -> None:
    if acceptance not in ACCEPTANCE_RULES:
        raise InvalidRequestError(f"acceptance={acceptance!r} is not one of: {', '.join(ACCEPTANCE_RULES)}.")
    if acceptance == "typical" and method not in TREE_METHODS:
        raise InvalidRequestError(
            f'acceptance="typical" applies to the tree methods ({", ".join(TREE_METHODS)}) only, not method={method!r}.'
        )


def check_k_policy(k_policy: str, k_max: int) -> str:
    """``k_policy``, checked (with ``k_max``)."""
    if k_policy not in K_POLICY_CHOICES:
        raise InvalidRequestError(f"k policy must be one of {', '.join(K_POLICY_CHOICES)}, got {k_policy!r}.")
    if not 1 <= k_max <= MAX_K_MAX:
        raise InvalidRequestError(f"k_max={k_max} is out of range: use 1..{MAX_K_MAX}.")
    return k_policy


def check_ngram_sizes(ngram_max: int, ngram_min: int) -> None:
    if not 1 <= ngram_min <= ngram_max:
        raise InvalidRequestError(
            f"n-gram sizes need 1 <= ngram_min <= ngram_max, got min {ngram_min} and max {ngram_max}."
        )


def resolve_k(k: int | str | None, k_policy: str | None) -> tuple[int | None, str | None]:
    """(fixed k or None, policy or None) from ``k`` (an int, "auto" or None) and ``k_policy``:
    "auto" is the cost policy (or the threshold one)."""
    if isinstance(k, str):
        if k != "auto":
            raise InvalidRequestError(f"k must be a positive integer or 'auto', got {k!r}.")
        if k_policy == "fixed":
            raise InvalidRequestError("k='auto' needs k_policy 'cost' or 'threshold', not 'fixed'.")
        return None, k_policy or "cost"
    return k, k_policy


# The batch engine's sharing of seats and steps between requests (engine/scheduler.py).
DEFAULT_PREFILL_CHUNK = 512  # llama-server's default micro-batch; ~4 s of the demo target on 2 CPU cores
DEFAULT_TIME_SLICE = 16  # decode steps
DEFAULT_SPARE_SLOTS = 2


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    """How the continuous-batching engine shares the batch between requests, so that a request's
    first token never waits for other requests to finish (docs/design.md#fair-scheduling).

    ``prefill_chunk``: the most prompt tokens prefilled in one step, over every request being
      prefilled (shortest remaining first); a longer prompt is prefilled over several steps
      while the batch keeps decoding. 0: whole prompts in one pass.
    ``time_slice``: decode steps a request keeps its batch seat once admitted. When the batch is
      full and a waiting request has taken part in at least ``time_slice`` fewer steps than a
      running one that has run ``time_slice`` steps since it was admitted, that one is preempted
      (its K/V stay cached) and the waiting one takes its seat. 0: never preempt for fairness.
    ``spare_slots``: llama.cpp only: sequence slots beyond ``max_batch`` per context, each of
      the same size, where a preempted request's K/V stay until it returns (and a finished
      one's, for the prefix cache). Without one, fairness cannot preempt on llama.cpp (a
      preempted request would have to recompute its whole context). Paged torch pools keep a
      preempted request's blocks on their LRU list instead.
    """

    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    time_slice: int = DEFAULT_TIME_SLICE
    spare_slots: int = DEFAULT_SPARE_SLOTS

    def __post_init__(self) -> None:
        for name in ("prefill_chunk", "time_slice", "spare_slots"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidRequestError(f"{name} must be an integer >= 0, got {value!r}.")
