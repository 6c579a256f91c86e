"""The methods a benchmark compares, behind one interface: run one turn, return its figures.

specdecode's own methods are every entry of the method registry (``core/registry.py``: a
new method registered there is benchmarked without changes here). The peers are Hugging Face
transformers' ``generate`` on the same weights, dtype and device:

- ``hf``: plain ``generate``;
- ``hf-assisted``: ``generate(assistant_model=draft)`` with transformers' default schedule;
- ``hf-lookup``: ``generate(prompt_lookup_num_tokens=N)`` (n-gram prompt lookup).

A specdecode method may name its draft length after a colon: ``draft:3``, ``draft:auto``
(cost-aware k per step), ``draft:threshold`` (the threshold rule), ``ngram:auto``. It may
name weight quantizations: ``none@int8`` is plain decoding of the
int8 target, ``draft@int8/int4`` the draft method with an int8 target and an int4 draft
(``models.quantize``). Its greedy output is checked against plain decoding of the same quantized
target, and its speedup against ``none`` (the unquantized target). The same slot may name
the backend instead: ``draft@llama.cpp`` runs the draft method on the llama.cpp backend (the
GGUF files themselves, which carry their own quantization, so the two cannot combine); its
output is checked against ``none@llama.cpp`` and its speedup given against ``none`` and
``none@llama.cpp``.

The llama.cpp peers (``bench/llamacpp_peers.py``, ``bench/llamacpp_bin.py``) run the same
GGUF files: ``llamacpp`` and ``llamacpp-lookup`` through llama-cpp-python's high-level
``Llama``, ``llamacpp-bin-draft`` and ``llamacpp-bin-lookup`` through llama.cpp's own
``llama-speculative-simple`` and ``llama-lookup`` binaries; their outputs are checked
against ``llamacpp``.

transformers exposes no acceptance counts, so for its methods we count forward passes with
module hooks: tau is new tokens per target pass (1.0 exactly for ``hf``), the first target
pass is reported as prefill, later ones as verify, assistant passes as draft; the acceptance
rate is left empty rather than guessed.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

import torch

from specdecode.config import DRAFT_MODEL_METHODS, METHODS, SamplingParams
from specdecode.core import registry
from specdecode.engine.trace import PassTrace
from specdecode.errors import InvalidRequestError
from specdecode.models.quantize import QUANT_CHOICES

HF_METHODS = ("hf", "hf-assisted", "hf-lookup")
PLAIN_METHOD = registry.NONE.name  # specdecode's plain decoding: the baseline of its own methods
HF_PLAIN_METHOD = "hf"
DEFAULT_HF_LOOKUP_TOKENS = 10  # transformers' documented example value
# llama.cpp's peers on the same GGUF files: llama-cpp-python's high-level Llama, then
# llama.cpp's own binaries (--llamacpp-bin).
LLAMACPP_PY_METHODS = ("llamacpp", "llamacpp-lookup")
LLAMACPP_BIN_METHODS = ("llamacpp-bin-draft", "llamacpp-bin-lookup")
LLAMACPP_PEERS = LLAMACPP_PY_METHODS + LLAMACPP_BIN_METHODS
LLAMACPP_PLAIN_PEER = "llamacpp"
# llama-cpp-python's README: 10 "is the default and generally good for gpu, 2 performs better
# for cpu-only machines"; this harness measures the CPU, so the CPU user's choice.
DEFAULT_LLAMACPP_LOOKUP_TOKENS = 2
PEERS = HF_METHODS + LLAMACPP_PEERS  # other libraries' methods: no draft length, quantization or backend

QUANT_MARK = "@"  # the slot after it names weight quantizations or the backend
K_MARK = ":"
ADAPTIVE_K = {"auto": "cost", "threshold": "threshold"}  # label suffix -> k policy
TORCH = "torch"
LLAMACPP = "llama.cpp"  # as backends.select spells it
PLAIN_LLAMACPP_METHOD = f"{PLAIN_METHOD}{QUANT_MARK}{LLAMACPP}"  # our plain decoding on llama.cpp


def default_methods() -> tuple[str, ...]:
    """What a run without --methods compares: specdecode's methods (plain first), then the
    Hugging Face peers. The llama.cpp side is asked for by name (it needs GGUF files)."""
    own = (PLAIN_METHOD,) + tuple(m for m in METHODS if m != PLAIN_METHOD)
    return own + HF_METHODS


def available_methods() -> tuple[str, ...]:
    """Every base method name: the defaults, then the llama.cpp peers."""
    return default_methods() + LLAMACPP_PEERS


NO_CACHE_MARK = "+nocache"  # a method label without the prefix cache: draft:auto@llama.cpp+nocache


@dataclass(frozen=True, slots=True)
class MethodLabel:
    """A benchmark method name taken apart: ``draft@int8/int4`` -> draft, int8 target, int4 draft."""

    base: str
    target_quant: str = "none"
    draft_quant: str = "none"
    k: int | None = None  # fixed draft length for this method (None: the run's --k)
    k_policy: str | None = None  # "cost" or "threshold" for an adaptive draft length
    backend: str = TORCH  # where the method's passes run: "torch" or "llama.cpp" (the llama.cpp peers too)
    # "+nocache": every turn prefills its whole prompt, as before the prefix cache (the
    # comparison it is measured by, in the same run).
    prefix_cache: bool = True

    @property
    def plain(self) -> str:
        """The plain decoding (same library, same backend, same quantized target) this method
        must reproduce."""
        if self.base in HF_METHODS:
            return HF_PLAIN_METHOD
        if self.base in LLAMACPP_PEERS:
            return LLAMACPP_PLAIN_PEER
        if self.backend == LLAMACPP:
            return PLAIN_LLAMACPP_METHOD
        return PLAIN_METHOD if self.target_quant == "none" else f"{PLAIN_METHOD}{QUANT_MARK}{self.target_quant}"

    @property
    def on_llamacpp(self) -> bool:
        """Whether the method reads the GGUF files through llama.cpp (ours on that backend, or a peer)."""
        return self.backend == LLAMACPP


def parse_method(label: str) -> MethodLabel:
    if label.endswith(NO_CACHE_MARK):
        parsed = parse_method(label[: -len(NO_CACHE_MARK)])
        if parsed.base in PEERS:
            raise InvalidRequestError(f"{label}: {NO_CACHE_MARK} applies to specdecode's methods only.")
        return replace(parsed, prefix_cache=False)
    head, marked, quants = label.partition(QUANT_MARK)
    base, k_marked, k_text = head.partition(K_MARK)
    known = available_methods()
    if base not in known:
        raise InvalidRequestError(
            f"Unknown method {base!r}; choose from: {', '.join(known)} (optionally with :k, and @quant or @llama.cpp)."
        )
    k, k_policy = None, None
    if k_marked:
        if base in PEERS or base == PLAIN_METHOD:
            raise InvalidRequestError(f"{label}: a draft length applies to specdecode's speculative methods only.")
        if base == "auto" and k_text in ADAPTIVE_K:
            raise InvalidRequestError(f"{label}: the auto method chooses its own source and draft length; ':N' sets its draft model's k.")
        if k_text in ADAPTIVE_K:
            k_policy = ADAPTIVE_K[k_text]
        elif k_text.isdigit() and int(k_text) >= 1:
            k = int(k_text)
        else:
            raise InvalidRequestError(f"{label}: the draft length after ':' must be a positive integer, 'auto' or 'threshold'.")
    if not marked:
        return MethodLabel(base, k=k, k_policy=k_policy, backend=LLAMACPP if base in LLAMACPP_PEERS else TORCH)
    if base in PEERS:
        raise InvalidRequestError(
            f"{label}: quantized and llama.cpp variants exist for specdecode's methods only, not {base} "
            "(the llama.cpp peers already run the GGUF files on llama.cpp)."
        )
    if LLAMACPP in quants.split("/"):
        return _llamacpp_label(label, base, k, k_policy, quants)
    target_quant, slash, draft_quant = quants.partition("/")
    draft_quant = draft_quant if slash else "none"
    if slash and not uses_draft_model(base):
        raise InvalidRequestError(f"{label}: only the draft method has a draft model to quantize.")
    for quant in (target_quant, draft_quant):
        if quant not in QUANT_CHOICES:
            raise InvalidRequestError(f"{label}: quantization must be one of {', '.join(QUANT_CHOICES)} (or '@{LLAMACPP}' for the backend), got {quant!r}.")
    return MethodLabel(base, target_quant, draft_quant, k, k_policy)


def _llamacpp_label(label: str, base: str, k: int | None, k_policy: str | None, slot: str) -> MethodLabel:
    """``METHOD[:K]@llama.cpp``: specdecode's method on the llama.cpp backend."""
    if slot != LLAMACPP:
        raise InvalidRequestError(
            f"{label}: quantization and llama.cpp cannot be combined (a GGUF file carries its own "
            f"quantization; pick a quantized GGUF instead): write {base}{QUANT_MARK}{LLAMACPP}."
        )
    if base in registry.TORCH_ONLY_METHODS:
        raise InvalidRequestError(
            f"{label}: method {base} needs the torch model (tree attention, hidden states or skipped layers); "
            f"on llama.cpp choose from: {', '.join(m for m in default_methods() if m not in registry.TORCH_ONLY_METHODS + PEERS)}."
        )
    return MethodLabel(base, k=k, k_policy=k_policy, backend=LLAMACPP)


def plain_counterpart(method: str) -> str:
    """The plain decoding whose output a method must reproduce under greedy."""
    return parse_method(method).plain


def uses_draft_model(method: str) -> bool:
    return method.partition(QUANT_MARK)[0].partition(K_MARK)[0] in DRAFT_MODEL_METHODS + ("hf-assisted", "llamacpp-bin-draft")


@dataclass(slots=True)
class TurnResult:
    """One generation (one turn of one prompt) by one method."""

    tokens: list[int]
    text: str
    prompt_tokens: int
    seconds: float
    prefill_seconds: float
    draft_seconds: float
    verify_seconds: float
    target_passes: int  # prefill included
    draft_passes: int
    verify_steps: int  # target passes that emitted tokens
    emitted_by_steps: int  # tokens those passes emitted (before truncation at max_new_tokens)
    draft_tokens_proposed: int | None = None  # None: the method does not expose it
    draft_tokens_accepted: int | None = None
    proposed_at_position: list[int] = field(default_factory=list)
    accepted_at_position: list[int] = field(default_factory=list)
    steps_by_source: dict[str, int] = field(default_factory=dict)  # method auto: steps per source
    # Peak resident memory of the whole process during the turn (every loaded model, and the
    # memory-mapped weight files, included) and how far it rose above the turn's start (the
    # memory the method itself needed: KV caches, activations, draft state).
    peak_rss_bytes: int | None = None
    run_rss_bytes: int | None = None
    # Methods suffix and auto: the earlier responses kept after the turn (tokens) and the heap
    # bytes of their suffix trees.
    suffix_cache_tokens: int | None = None
    suffix_cache_bytes: int | None = None
    # Prompt tokens served from specdecode's prefix cache (a conversation's earlier turns); None:
    # the method does not say.
    cached_tokens: int | None = None
    first_token_seconds: float | None = None  # from the request's start to its first token (None: not measured)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class BenchMethod(Protocol):
    name: str

    def run_turn(self, prompt_ids: list[int], params: SamplingParams) -> TurnResult:
        """Generate for ``prompt_ids`` and measure it."""


class SpecDecodeMethod:
    """One of specdecode's methods through the public ``SpecDecoder`` API."""

    def __init__(self, name: str, decoder: Any, k: int | None = None) -> None:
        self.name = name  # the label, draft length and quantization included
        label = parse_method(name)
        self.base = label.base
        self.decoder = decoder  # loaded with the label's quantizations
        self.k: int | str | None = "auto" if label.k_policy else (label.k if label.k is not None else k)
        self.k_policy = label.k_policy
        self.prefix_cache = label.prefix_cache
        self.trace = False  # record each turn's passes (``last_trace``) for the oracle's pricing
        self.last_trace: PassTrace | None = None

    def start_conversation(self) -> None:
        """A new prompt: forget earlier responses, so that suffix decoding drafts only from this
        conversation (never from another method's, or an earlier repeat's, answer to it), and
        the cached prefix, so that its first turn prefills its prompt as a fresh request does
        (its later turns reuse the earlier ones, as a chat's do)."""
        self.decoder.suffix_cache.clear()
        self.decoder.forget_prefix()

    def run_turn(self, prompt_ids: list[int], params: SamplingParams) -> TurnResult:
        if not self.prefix_cache:
            self.decoder.forget_prefix()
        with self.decoder.trace_passes() if self.trace else contextlib.nullcontext() as trace:
            result = self.decoder.generate(prompt_ids, params, method=self.base, k=self.k, k_policy=self.k_policy)
        self.last_trace = trace
        stats = result.stats
        suffix = self.decoder.suffix_cache.stats(measure_bytes=True) if registry.BY_NAME[self.base].uses_suffix_cache else None
        return TurnResult(
            tokens=result.token_ids,
            text=result.text,
            prompt_tokens=stats.prompt_tokens,
            seconds=stats.total_seconds,
            prefill_seconds=stats.prefill_seconds,
            draft_seconds=stats.draft_seconds,
            verify_seconds=stats.verify_seconds,
            target_passes=stats.target_forward_passes,
            draft_passes=stats.draft_forward_passes,
            verify_steps=stats.verify_steps,
            emitted_by_steps=stats.emitted_by_steps,
            draft_tokens_proposed=stats.draft_tokens_proposed,
            draft_tokens_accepted=stats.draft_tokens_accepted,
            proposed_at_position=list(stats.proposed_at_position),
            accepted_at_position=list(stats.accepted_at_position),
            steps_by_source=dict(stats.steps_by_source),
            suffix_cache_tokens=suffix.tokens if suffix else None,
            suffix_cache_bytes=suffix.bytes if suffix else None,
            cached_tokens=stats.cached_tokens,
            first_token_seconds=stats.first_token_seconds,
        )


class _PassTimer:
    """Counts and times a module's forward calls through hooks, removed on exit."""

    def __init__(self, module: torch.nn.Module | None, sync_cuda: bool) -> None:
        self.module = module
        self.sync_cuda = sync_cuda
        self.durations: list[float] = []
        self._started = 0.0
        self._handles: list[Any] = []

    def _sync(self) -> None:
        if self.sync_cuda:
            torch.cuda.synchronize()

    def _pre(self, *_: Any) -> None:
        self._sync()
        self._started = time.perf_counter()

    def _post(self, *_: Any) -> None:
        self._sync()
        self.durations.append(time.perf_counter() - self._started)

    def __enter__(self) -> _PassTimer:
        if self.module is not None:
            self._handles = [
                self.module.register_forward_pre_hook(self._pre),
                self.module.register_forward_hook(self._post),
            ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()


class HFMethod:
    """transformers ``generate`` with the same decoding rule as specdecode's SamplingParams."""

    def __init__(
        self,
        name: str,
        target: Any,
        tokenizer: Any,
        eos_token_ids: list[int],
        draft: Any = None,
        lookup_tokens: int = DEFAULT_HF_LOOKUP_TOKENS,
    ) -> None:
        if name not in HF_METHODS:
            raise InvalidRequestError(f"Unknown Hugging Face method {name!r}; choose one of: {', '.join(HF_METHODS)}.")
        if name == "hf-assisted" and draft is None:
            raise InvalidRequestError("hf-assisted needs a draft model (draft=).")
        import transformers

        # Its per-call deprecation notices would bury the benchmark's own output.
        transformers.logging.set_verbosity_error()
        self.name = name
        self.target = target
        self.tokenizer = tokenizer
        self.draft = draft if name == "hf-assisted" else None
        self.eos_token_ids = eos_token_ids
        self.lookup_tokens = lookup_tokens

    def _generate_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(
            max_new_tokens=params.max_new_tokens,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.eos_token_ids[0],
            # transformers fills unset fields from the checkpoint's generation_config.json,
            # which may carry a repetition penalty or top-k: pin every one that changes the
            # distribution so both libraries decode by the same rule.
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
        )
        if params.temperature > 0:
            kwargs.update(do_sample=True, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=0.0, typical_p=1.0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        if self.name == "hf-assisted":
            kwargs["assistant_model"] = self.draft
        elif self.name == "hf-lookup":
            kwargs["prompt_lookup_num_tokens"] = self.lookup_tokens
        return kwargs

    @torch.inference_mode()
    def run_turn(self, prompt_ids: list[int], params: SamplingParams) -> TurnResult:
        device = self.target.device
        input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
        if params.seed is not None:
            torch.manual_seed(params.seed)
        sync = device.type == "cuda"
        with _PassTimer(self.target, sync) as target_timer, _PassTimer(self.draft, sync) as draft_timer:
            started = time.perf_counter()
            out = self.target.generate(input_ids, attention_mask=torch.ones_like(input_ids), **self._generate_kwargs(params))
            new = out[0, len(prompt_ids) :].tolist()  # syncs the device
            seconds = time.perf_counter() - started
        tokens = _cut_at_eos(new, self.eos_token_ids)
        passes = len(target_timer.durations)
        return TurnResult(
            tokens=tokens,
            text=self.tokenizer.decode(tokens, skip_special_tokens=True),  # as specdecode's API decodes
            prompt_tokens=len(prompt_ids),
            seconds=seconds,
            prefill_seconds=target_timer.durations[0] if passes else 0.0,
            draft_seconds=sum(draft_timer.durations),
            verify_seconds=sum(target_timer.durations[1:]),
            target_passes=passes,
            draft_passes=len(draft_timer.durations),
            verify_steps=passes,  # every target pass, the first included, emits tokens
            emitted_by_steps=len(tokens),
        )


def _cut_at_eos(tokens: list[int], eos_token_ids: list[int]) -> list[int]:
    """generate() pads after the end token; keep up to and including the first end token."""
    for i, token in enumerate(tokens):
        if token in eos_token_ids:
            return tokens[: i + 1]
    return tokens
