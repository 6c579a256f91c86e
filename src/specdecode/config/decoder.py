"""How a decoder speculates: ``DecoderConfig`` (what to load, the method, k and its policy) and
the checks its fields share with a call's overrides."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields
from typing import Any

from specdecode.core import registry
from specdecode.core.device import DEVICES
from specdecode.errors import InvalidRequestError

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
# auto: the batch engine holding one request (as "batch"); "single": the single-request engine.
ENGINES: tuple[str, ...] = ("auto", "single", "batch")


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
    make a fixed k lose to plain decoding (docs/design.md#backends). Left None (torch),
    ``generate`` and ``stream`` draft a fixed k and a batch engine of many requests
    (``generate_batch``, the server) chooses k for the batch as a whole (``cost``, up to k); a
    policy given is honoured everywhere (a batch row of ``fixed`` or ``threshold`` gets its own
    k: ``engine/batch_rows.py``).
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
    # Which engine generate and stream decode on (ENGINES): the batch engine holding one request
    # (engine/one_request.py), as the server and generate_batch always do (auto, the default),
    # or the single-request engine (``resolve_engine``).
    engine: str = "auto"

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
            raise InvalidRequestError(
                f"grammar_timeout={self.grammar_timeout} is out of range: use seconds > 0, or "
                "None to compile in this thread with no limit."
            )
        if self.grammar_cache_bytes < 0:
            raise InvalidRequestError(f"grammar_cache_bytes={self.grammar_cache_bytes} is out of range: use >= 0.")
        for name, choices in (
            ("backend", BACKEND_CHOICES),
            ("dtype", DTYPES),
            ("target_quant", QUANTS),
            ("draft_quant", QUANTS),
            ("kv_dtype", KV_DTYPES),
        ):
            if getattr(self, name) not in choices:
                raise InvalidRequestError(f"{name}={getattr(self, name)!r} is not one of: {', '.join(choices)}.")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise InvalidRequestError(f"device={self.device!r} is not one of: {', '.join(DEVICES)} (or cuda:N).")
        if self.compile is None:
            object.__setattr__(self, "compile", False)
        if not isinstance(self.compile, bool) and self.compile not in COMPILE_MODES:
            raise InvalidRequestError(
                f"compile must be True, False or one of {', '.join(COMPILE_MODES)}, got {self.compile!r}."
            )
        check_engine(self.engine)
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
        """The draft length in force: ``k``, or where none was given ``DEFAULT_K`` (at most ``k_max``)."""
        return self.k if self.k is not None else min(DEFAULT_K, self.k_max)

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


def check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise InvalidRequestError(f"engine={engine!r} is not one of: {', '.join(ENGINES)}.")


def resolve_engine(engine: str) -> str:
    """The engine a call decodes on: "auto" is "batch" (every method and setting runs there,
    compiled passes included: ``backends/compiled_batch.py``); "single" keeps the
    single-request engine, which ``audit``'s probes and layer search also use."""
    check_engine(engine)
    return "batch" if engine == "auto" else engine


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
