"""Structured outputs: a grammar masks the target's rows, and speculation stays exact under it.

The grammar engine is xgrammar (a maintained one made for this; docs/structured.md says why
it and not llguidance, with the timings). A request's ``StructuredOutput`` (config/sampling.py) is
compiled once per decoder's tokenizer (``GrammarCompiler``, which caches compiled grammars);
each request gets its own matcher (``GrammarState``) that follows the committed tokens.

Exactness. With the grammar, the distribution to sample from at each position is the target's
row with every token the grammar forbids at that position set to -inf, renormalised (then
temperature, top-k and top-p, exactly as plain constrained decoding applies them). A verify
pass over drafts d_1..d_k holds rows p_0..p_k; row i is masked with the grammar's state after
the committed tokens plus d_1..d_i (``masks``: the matcher walks the drafts and is back where it
was afterwards). A draft token the grammar forbids has p = 0 and is rejected; the rows below it
are never reached (they are left unmasked). Rejection sampling is exact for any proposal q, so
a draft model sampling from its unmasked q stays lossless; a deterministic draft (prompt lookup,
suffix trees, greedy) can be cut at its first forbidden token before the pass, which changes
nothing: its residual at that row is p itself (``first_forbidden``).

Forced tokens (jump-forward). Where the grammar allows one continuation only (``{"name": "``
of a schema with a ``name`` property), that text is drafted in the tokenizer's own tokens
(``GrammarState.forced_tokens``), in place of the drafter's proposal, and verified like any
deterministic draft: accepted with the masked target's probability for it, which is 1 where
the token is the only one the grammar allows (a forced text has other spellings in a BPE
vocabulary, ``{"`` or ``{`` then ``"``, so a token of it can still be rejected, and then the
target's own choice is emitted: exact either way). Plain decoding under a grammar uses it too.

One cost beyond plain decoding: the drafts must be on the host for the matcher, one more
device-to-host read per step on a GPU (the grammar engines run on the CPU).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from specdecode.config import DEFAULT_GRAMMAR_CACHE_BYTES, DEFAULT_GRAMMAR_TIMEOUT, StructuredOutput
from specdecode.engine.grammar_check import check_grammar
from specdecode.engine.grammar_child import GrammarRefused, build_and_compile, first_line
from specdecode.engine.grammar_process import (
    CompileBoundError,
    CompileProcess,
    compile_process,
    not_compiled,
    refused,
    release_freed_memory,
)
from specdecode.errors import InvalidRequestError

# The longest run of whitespace JSON may hold between tokens: enough for a newline and the
# indent of pretty-printed JSON 9 levels deep, and a bound on the whitespace loops some models
# fall into under free whitespace (vLLM added its disable-any-whitespace option for those).
MAX_WHITESPACE = 20
# The most forced tokens one step drafts: a schema's forced runs (`", "arguments": {"city": "`)
# are 2-10 tokens; a longer run is drafted over several steps.
MAX_FORCED_TOKENS = 16
# Characters of a forced text tokenized per token drafted: a forced run can be long (a regex's
# ``a{5000}``), and only its first few tokens are drafted in one step.
FORCED_CHARS_PER_TOKEN = 32
FAILED_SPECS = 256  # failed specs remembered, so that a resent one is refused without compiling
# How long a spec stopped by a bound (its deadline, the memory bound) stays refused: long enough
# that a client resending it cannot keep the compile process busy, short enough that a spec
# that timed out on a loaded machine is tried again later.
BOUND_FAILURE_SECONDS = 300.0
INSTALL_HINT = "Structured outputs need xgrammar: pip install 'specdecode[structured]'."


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as err:  # an optional extra
        raise InvalidRequestError(INSTALL_HINT) from err
    return xgrammar


def json_schema_ebnf(schema: dict[str, Any], any_whitespace: bool = False) -> str:
    """A JSON schema as xgrammar EBNF, to embed in a larger grammar (a structural tag's
    ``grammar`` element); InvalidRequestError when xgrammar cannot read the schema."""
    xgr = _xgrammar()
    try:
        return str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=any_whitespace,
                                                max_whitespace_cnt=MAX_WHITESPACE if any_whitespace else None))
    except Exception as err:  # noqa: BLE001 - the schema is the request's; xgrammar raises several kinds
        raise not_compiled("JSON schema", first_line(err)) from err


class GrammarCompiler:
    """Compiles ``StructuredOutput`` specs for one tokenizer; thread-safe, caches by spec.

    Building xgrammar's tokenizer info reads the whole vocabulary (0.7-1 s for the demo's 151k
    tokens on a 2-core CPU), so it happens on the first structured request, not at load; a server
    calls ``warm`` at start so that no request pays it.

    Bounds (a request's grammar must not take the process down): with ``timeout`` (seconds) a
    compile runs in a child process that is killed past it or past a memory bound
    (``engine/grammar_process.py``; None: in this thread, unbounded, for a caller that trusts its
    specs); compiled grammars are kept least recently used first within ``cache_bytes``
    (xgrammar's own size estimate); and a grammar in which some way cannot end is refused before
    decoding (``engine/grammar_check.py``). A spec that failed is remembered too (the last
    ``FAILED_SPECS``; one stopped by a bound for ``BOUND_FAILURE_SECONDS``), so that sending it
    again is refused at once instead of compiling again."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 jump_forward: bool = True, timeout: float | None = DEFAULT_GRAMMAR_TIMEOUT,
                 cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        self.stop_token_ids = list(stop_token_ids)
        self.jump_forward = jump_forward  # draft the tokens the grammar forces (DecoderConfig.jump_forward)
        self.timeout = timeout
        self.cache_bytes = cache_bytes
        self._info: Any = None
        self._compiler: Any = None  # in-process compiler (timeout None)
        self._process: CompileProcess | None = None
        self._lock = threading.Lock()  # the tokenizer info, the cache
        # xgrammar's compiled grammars and their sizes, least recently used first.
        self._cache: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        # Failed specs: the error and until when (time.monotonic()) it stands.
        self._failed: OrderedDict[str, tuple[InvalidRequestError, float]] = OrderedDict()
        self.cached_bytes = 0

    def _tokenizer_info(self) -> Any:
        with self._lock:
            if self._info is None:
                xgr = _xgrammar()
                self._info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                                stop_token_ids=self.stop_token_ids)
            return self._info

    def _compile_process(self) -> CompileProcess:
        if self._process is None:
            self._process = compile_process(self._tokenizer_info().serialize_json())
        return self._process

    def warm(self) -> float | None:
        """Build the tokenizer info (and start the compile process) now; its seconds, or None when
        xgrammar is not installed (structured requests then get the install hint)."""
        started = time.perf_counter()
        try:
            self._tokenizer_info()
            if self.timeout is not None:
                self._compile_process().start()
        except InvalidRequestError:
            return None
        return time.perf_counter() - started

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """The compiled grammar, or InvalidRequestError saying what is wrong with the spec."""
        builder, args, kwargs = _compile_call(spec)
        key = json.dumps([builder, args, kwargs], sort_keys=True)
        tokenize = self._tokenize if self.jump_forward else None
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return CompiledGrammar(self._cache[key][0], self.vocab_size, spec, tokenize)
            if key in self._failed:
                error, until = self._failed[key]
                if time.monotonic() < until:
                    self._failed.move_to_end(key)
                    raise error
                del self._failed[key]
        try:
            compiled = self._compile(spec, builder, args, kwargs)
        except InvalidRequestError as err:
            until = time.monotonic() + BOUND_FAILURE_SECONDS if isinstance(err, CompileBoundError) else float("inf")
            with self._lock:
                self._failed[key] = (err, until)
                while len(self._failed) > FAILED_SPECS:
                    self._failed.popitem(last=False)
            raise
        with self._lock:
            self._remember(key, compiled)
        if self.timeout is not None:
            release_freed_memory()  # the compiled grammar's JSON, read back from the compile process
        return CompiledGrammar(compiled, self.vocab_size, spec, tokenize)

    def _compile(self, spec: StructuredOutput, builder: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        """xgrammar's compiled grammar for ``spec``, checked (``grammar_child.build_and_compile``)."""
        xgr = _xgrammar()
        info = self._tokenizer_info()
        if self.timeout is not None:
            serialized = self._compile_process().compile(builder, args, kwargs, spec.kind, self.timeout)
            return xgr.CompiledGrammar.deserialize_json(serialized, info)
        with self._lock:
            if self._compiler is None:
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        try:
            return build_and_compile(xgr, self._compiler, check_grammar, builder, args, kwargs)
        except GrammarRefused as err:
            raise refused(spec.kind, str(err)) from err
        except Exception as err:  # noqa: BLE001 - the spec is the request's; xgrammar raises several kinds
            raise not_compiled(spec.kind, first_line(err)) from err

    def _remember(self, key: str, compiled: Any) -> None:
        """Keep ``compiled``, dropping the least recently used grammars past ``cache_bytes`` (a
        grammar larger than the whole bound is not kept; requests using a dropped grammar keep it
        alive until they end)."""
        size = int(compiled.memory_size_bytes)
        if size > self.cache_bytes:
            return
        self._cache[key] = (compiled, size)
        self.cached_bytes += size
        while self.cached_bytes > self.cache_bytes:
            _, (_, dropped) = self._cache.popitem(last=False)
            self.cached_bytes -= dropped

    def _tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def _compile_call(spec: StructuredOutput) -> tuple[str, list[Any], dict[str, Any]]:
    """The grammar builder (``grammar_child.BUILDERS``) and its arguments (JSON values: they travel
    to the compile process) that make ``spec``'s grammar."""
    if spec.json_schema is not None:
        schema = spec.json_schema if isinstance(spec.json_schema, str) else json.dumps(spec.json_schema)
        return "json_schema", [schema], {"any_whitespace": spec.any_whitespace, "strict_mode": spec.strict,
                                         "max_whitespace_cnt": MAX_WHITESPACE}
    if spec.json_object:  # any JSON object (OpenAI's JSON mode), not any JSON value
        return "json_schema", ['{"type": "object"}'], {"any_whitespace": spec.any_whitespace,
                                                        "max_whitespace_cnt": MAX_WHITESPACE}
    if spec.regex is not None:
        return "regex", [spec.regex], {}
    if spec.choice is not None:
        return "regex", ["|".join(_regex_escape(c) for c in spec.choice)], {}
    if spec.structural_tag is not None:
        return "structural_tag", [json.dumps(spec.structural_tag)], {}
    assert spec.grammar is not None
    return "ebnf", [spec.grammar], {}


def _regex_escape(text: str) -> str:
    # xgrammar's regex dialect is ECMAScript-like; escape every metacharacter it knows, and write
    # control characters as \uXXXX (it refuses a raw NUL; the schema fuzz sent a choice "\x00").
    return "".join("\\" + ch if ch in r"\^$.|?*+()[]{}/-" else f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ch == "\x7f"
                   else ch for ch in text)


class CompiledGrammar:
    """A compiled grammar for one tokenizer; ``state()`` starts a request's matcher."""

    def __init__(self, compiled: Any, vocab_size: int, spec: StructuredOutput,
                 tokenize: Callable[[str], list[int]] | None = None) -> None:
        self.compiled = compiled
        self.vocab_size = vocab_size
        self.spec = spec
        self.tokenize = tokenize  # text -> token ids, for forced tokens (None: not drafted)

    def state(self) -> GrammarState:
        return GrammarState(self)


class GrammarState:
    """One request's place in its grammar: advanced by committed tokens, asked for masks."""

    def __init__(self, grammar: CompiledGrammar) -> None:
        self._xgr = _xgrammar()
        self.matcher = self._xgr.GrammarMatcher(grammar.compiled)
        self.vocab_size = grammar.vocab_size
        self._tokenize = grammar.tokenize
        self.mask_seconds = 0.0  # time spent computing masks and advancing (stats.mask_seconds)
        self._drafted = 0  # tokens a draft walk moved the matcher by (rolled back by end_draft)
        self._walk_blocked = False

    @property
    def terminated(self) -> bool:
        """The grammar reached its end and accepted a stop token: nothing more may follow."""
        return self.matcher.is_terminated()

    def advance(self, tokens: Sequence[int]) -> None:
        """Commit tokens (each one a token the masks allowed)."""
        for token in tokens:
            if self.matcher.is_terminated():
                return
            if not self.matcher.accept_token(token):
                raise RuntimeError(f"token {token} was emitted but the grammar forbids it: a masking bug")

    def forced_tokens(self, limit: int) -> list[int]:
        """The tokens of the text the grammar forces next (xgrammar's jump-forward string), as the
        tokenizer splits it, each checked by the matcher, which is back where it was afterwards:
        at most ``limit`` (what the step may draft) and ``MAX_FORCED_TOKENS``; [] when nothing is
        forced (or jump-forward is off)."""
        limit = min(limit, MAX_FORCED_TOKENS)
        if self._tokenize is None or limit <= 0 or self.matcher.is_terminated():
            return []
        started = time.perf_counter()
        tokens: list[int] = []
        # Bounded by the state's shortest completion: every way through the grammar can end
        # (engine/grammar_check.py), so the forced text is finite. Only its head is tokenized.
        text = self.matcher.find_jump_forward_string()[: (limit + 1) * FORCED_CHARS_PER_TOKEN]
        if text:
            for token in self._tokenize(text)[:limit]:
                if not self.matcher.accept_token(token):
                    break  # a split the grammar does not allow token by token: draft up to it
                tokens.append(token)
            if tokens:
                self.matcher.rollback(len(tokens))
        self.mask_seconds += time.perf_counter() - started
        return tokens

    def masks(self, parents: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:  # -> (N, V) bool, CPU
        """Allowed tokens after each node of a draft tree (a chain is a tree with parents i - 1):
        node 0 is the last committed token (the matcher's state now); node i's row is the state
        after the path to it. Rows the grammar cannot reach (below a forbidden token) allow all."""
        started = time.perf_counter()
        size = len(parents)
        first_child = [-1] * size
        next_sibling = [-1] * size
        last_child = [-1] * size
        for node in range(1, size):
            parent = parents[node]
            if first_child[parent] < 0:
                first_child[parent] = node
            else:
                next_sibling[last_child[parent]] = node
            last_child[parent] = node
        bitmask = self._xgr.allocate_token_bitmask(size, self.vocab_size)  # all bits set: all allowed
        self.matcher.traverse_draft_tree(torch.tensor(first_child), torch.tensor(next_sibling),
                                         torch.tensor(list(tokens), dtype=torch.long), bitmask)
        allowed = unpack_bitmask(bitmask, self.vocab_size)
        # A row with nothing allowed follows a stop token (the request ends there): never
        # sampled from, but an all -inf row would turn into NaN probabilities.
        allowed[~allowed.any(dim=-1)] = True
        self.mask_seconds += time.perf_counter() - started
        return allowed

    def chain_masks(self, drafts: Sequence[int]) -> torch.Tensor:  # -> (k + 1, V) bool, CPU
        return self.masks([-1, *range(len(drafts))], [0, *drafts])

    # A draft model's walk: each drafted token is drawn from its row masked at the draft's place
    # in the grammar (``sampling.draw``), so it proposes only allowed tokens; its q is then the
    # masked distribution it really sampled from, which keeps rejection sampling exact. Each
    # drafted token is read on the host (a sync per draft token on a GPU).
    def begin_draft(self) -> None:
        self._drafted, self._walk_blocked = 0, False

    def mask_draft(self, logits: torch.Tensor) -> torch.Tensor:  # (1, V) -> (1, V)
        if self._walk_blocked or self.matcher.is_terminated():
            return logits  # past the grammar's end: the verify pass cuts these drafts
        started = time.perf_counter()
        bitmask = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        self.matcher.fill_next_token_bitmask(bitmask)
        allowed = unpack_bitmask(bitmask, self.vocab_size)
        self.mask_seconds += time.perf_counter() - started
        return apply_masks(logits, allowed)

    def push_draft(self, token: torch.Tensor) -> None:  # (1,) long
        if self._walk_blocked or self.matcher.is_terminated():
            return
        if self.matcher.accept_token(int(token[0])):
            self._drafted += 1
        else:
            self._walk_blocked = True

    def end_draft(self) -> None:
        """Back to the committed tokens' state, whatever the walk did."""
        if self._drafted:
            self.matcher.rollback(self._drafted)
        self._drafted, self._walk_blocked = 0, False


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:  # (N, W) int32 -> (N, V) bool
    """xgrammar's packed mask (bit j of word w allows token 32 w + j) as booleans."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1  # (N, W, 32)
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def first_forbidden(allowed: torch.Tensor, drafts: Sequence[int]) -> int:  # allowed: (k + 1, V) bool
    """How many drafts, from the first, the grammar allows in a row."""
    for i, token in enumerate(drafts):
        if not allowed[i, token]:
            return i
    return len(drafts)


def apply_masks(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits (..., T, V) with the forbidden tokens of each row set to -inf; ``allowed`` (T, V)
    bool on the host, moved to the logits' device in one copy."""
    allowed = allowed.to(logits.device, non_blocking=True)
    width = logits.shape[-1]
    if allowed.shape[-1] < width:  # logits wider than the mask: the extra ids are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[-1]), value=False)
    return logits.masked_fill(~allowed[..., :width], float("-inf"))


def apply_row_masks(logits: torch.Tensor, masks: dict[int, torch.Tensor]) -> torch.Tensor:
    """logits (B, T, V) with row b's first masks[b].shape[0] rows masked (-inf where forbidden);
    the other rows as they are. One host-to-device copy for the whole batch."""
    batch, width, vocab = logits.shape
    allowed = torch.ones((batch, width, vocab), dtype=torch.bool)
    for b, rows in masks.items():
        allowed[b, : rows.shape[0], : min(vocab, rows.shape[1])] = rows[:, :vocab]
        allowed[b, : rows.shape[0], rows.shape[1]:] = False
    return logits.masked_fill(~allowed.to(logits.device, non_blocking=True), float("-inf"))
