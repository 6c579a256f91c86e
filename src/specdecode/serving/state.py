"""The server's state: its options, the decoder it serves, the requests in flight.

``ServerState.prepare`` parses, validates and tokenizes a request body (off the event loop);
``check_room`` refuses a request when too many already wait for its engine, and
``limit_queue_time`` ends one that waits too long (backpressure: docs/server.md#security-and-limits);
``track``/``untrack`` keep the set of generations in flight, each with its timeout;
``drain`` ends them on shutdown (``serving/shutdown.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from specdecode.api import SpecDecoder
from specdecode.core import registry
from specdecode.errors import SpecDecodeError
from specdecode.serving.api_errors import APIError, client_message
from specdecode.serving.guard import GuardOptions, RetryLater
from specdecode.serving.metrics import ServerMetrics
from specdecode.serving.protocol import ParsedRequest, parse_request
from specdecode.serving.suffix_share import DEFAULT_SUFFIX_SHARE
from specdecode.serving.tools import OPEN
from specdecode.serving.worker import BatchWorker

DEFAULT_DRAIN_TIMEOUT = 10.0
# HTTP connections (serving/connections.py applies them to uvicorn). Here, not there: the CLI reads
# them to build its parser, and connections.py imports uvicorn, which only the serve extra installs.
DEFAULT_KEEP_ALIVE_TIMEOUT = 5.0  # uvicorn's default: an idle keep-alive connection is closed after it
DEFAULT_HEADER_TIMEOUT = 10.0  # seconds a client has to send a request's headers
# Connections and requests in flight at once; past it the guard answers 503 (but /health). Each
# request in flight holds a thread; a 2-core server has long queued everyone by then.
DEFAULT_MAX_CONNECTIONS = 512
# Backpressure. Requests that may wait for the batch (beyond its free seats) before new ones are
# refused with a 429, unless --max-waiting says: two batches' worth, so that a burst of twice the
# batch queues and each waiting request starts within about two requests' time, the same order
# as the queue-time limit. The floor keeps a burst of a few dozen (parallel tool calls, a
# benchmark's clients) queueing on a small batch, and on a batch of one.
WAITING_PER_BATCH_SEAT = 2
MIN_MAX_WAITING = 32
# Seconds a request may wait without starting to decode before it is ended with a 503: well
# within the minute after which proxies and clients commonly give up, so the client hears
# "overloaded" in time to retry elsewhere rather than timing out with nothing.
DEFAULT_MAX_QUEUE_TIME = 30.0
# Bounds of the Retry-After the backpressure refusals send (the estimate: ``retry_after``).
MIN_RETRY_AFTER_SECONDS = 1
MAX_RETRY_AFTER_SECONDS = 30
# Requests waiting for their grammar's compile at once; more queue for a thread (compiles run one
# at a time in the compile process anyway: engine/grammar_process.py).
GRAMMAR_WAIT_THREADS = 16
NORMALIZATION_SLACK = 4  # characters a tokenizer's Unicode normalization may fold into one, at most


class InFlight(Protocol):
    """What the registry of requests in flight needs of one (``serving/generation.py: Generation``):
    its event loop, timeout and queue-time timers, whether it has started decoding or ended
    (``settled``), and a way to stop it with a reason."""

    loop: asyncio.AbstractEventLoop
    timer: asyncio.TimerHandle | None
    queue_timer: asyncio.TimerHandle | None
    settled: asyncio.Event

    def stop(self, reason: APIError | None = None) -> None: ...


@dataclass(slots=True, frozen=True)
class ServerOptions:
    guard: GuardOptions = field(default_factory=GuardOptions)
    request_timeout: float | None = None  # seconds from admission; None: no limit
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT  # seconds in-flight requests get to finish on shutdown
    suffix_share: str = DEFAULT_SUFFIX_SHARE  # whose earlier responses suffix decoding reads: tenant, global, none
    # HTTP connections (serving/connections.py): seconds an idle keep-alive connection stays
    # open, connections and requests at once (None: no limit), seconds to send a request's headers.
    keep_alive_timeout: float = DEFAULT_KEEP_ALIVE_TIMEOUT
    max_connections: int | None = DEFAULT_MAX_CONNECTIONS
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    # Backpressure: requests that may wait for the batch (None: WAITING_PER_BATCH_SEAT x the
    # batch, at least MIN_MAX_WAITING), and seconds one may wait before starting (None: no limit).
    max_waiting: int | None = None
    max_queue_time: float | None = DEFAULT_MAX_QUEUE_TIME

    def __post_init__(self) -> None:
        if self.max_waiting is not None and self.max_waiting < 1:
            raise ValueError(f"max_waiting must be at least 1 (or None for the default), got {self.max_waiting}.")


@dataclass(slots=True)
class ServerState:
    decoder: SpecDecoder
    model_name: str
    aliases: tuple[str, ...]
    worker: BatchWorker  # its batch engine decodes every request
    options: ServerOptions = field(default_factory=ServerOptions)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    started: int = field(default_factory=lambda: int(time.time()))
    inflight: set[InFlight] = field(default_factory=set)  # touched on the event loop only
    draining: bool = False
    # Requests read or being tokenized, not yet handed to the batch (changed on the event loop
    # only): the batch worker's window waits for them, and only for them (serving/worker.py).
    arriving: int = 0
    # The most characters one token stands for (None: unknown): bounds a prompt's length before
    # it is tokenized (_check_prompt_chars).
    longest_token_chars: int | None = field(init=False, default=None)
    max_waiting: int = field(init=False, default=MIN_MAX_WAITING)  # options.max_waiting, or sized from the batch
    # Threads that wait for grammar compiles (compile_grammar), apart from asyncio's default pool
    # (6 threads on 2 cores), which prepares every request: eight requests waiting out their
    # compile deadline there held a plain completion's preparation for 10 s.
    grammar_waits: ThreadPoolExecutor = field(
        init=False, default_factory=lambda: ThreadPoolExecutor(GRAMMAR_WAIT_THREADS, thread_name_prefix="specdecode-grammar"))

    def method_of(self, request: ParsedRequest) -> str:
        return request.method or self.decoder.config.method

    def token_text(self, token: int) -> str:
        """A token's text alone, as logprobs name it (byte-level pieces of a character decode to U+FFFD)."""
        return str(self.decoder.tokenizer.decode([token]))

    def k_of(self, request: ParsedRequest) -> int | None:
        if self.method_of(request) == registry.NONE.name:
            return None
        return request.k if request.k is not None else self.decoder.config.draft_k

    @property
    def served_names(self) -> tuple[str, ...]:
        return (self.model_name, *self.aliases)

    @property
    def methods(self) -> tuple[str, ...]:
        """The methods this decoder serves: those that need nothing loaded or a draft model only
        where one is loaded (auto), and those whose drafter it loaded."""
        return tuple(m.name for m in registry.REGISTRY
                     if m.needs in (registry.NEEDS_NOTHING, registry.USES_DRAFT_MODEL) or m.name in self.decoder.drafters)

    @property
    def context_length(self) -> int:
        """The most tokens (prompt and output) a request may hold, as ``SpecDecoder.check_request`` counts."""
        context = self.decoder.target.config.max_position_embeddings
        if self.decoder.draft is not None:
            context = min(context, self.decoder.draft.config.max_position_embeddings)
        return context

    def __post_init__(self) -> None:
        self.longest_token_chars = longest_token_chars(self.decoder.tokenizer)
        if self.worker.arriving is None:
            self.worker.arriving = lambda: self.arriving
        self.max_waiting = self.options.max_waiting or default_max_waiting(self.worker)

    def check_room(self) -> None:
        """Refuse the request at once (429, with Retry-After) when ``max_waiting`` requests
        already wait behind a full batch. Checked once per request, so one of n choices may take
        the queue up to n - 1 past the bound."""
        waiting = self.worker.waiting
        if waiting < self.max_waiting:
            return
        self.metrics.count("overloaded")
        raise RetryLater(429, f"The server is overloaded: {waiting} requests are already waiting for the batch "
                              f"(--max-waiting {self.max_waiting}). Retry after the seconds in the Retry-After header.",
                         code="server_overloaded", retry_after=self.retry_after(), kind="rate_limit_error")

    def retry_after(self) -> int:
        """Seconds after which a refused request has a fair chance: about when a seat frees, the
        time recent requests held one divided by the batch's seats, within
        [MIN_RETRY_AFTER_SECONDS, MAX_RETRY_AFTER_SECONDS]."""
        held = self.metrics.mean_seat_seconds()
        if held is None:
            return MIN_RETRY_AFTER_SECONDS
        return min(MAX_RETRY_AFTER_SECONDS, max(MIN_RETRY_AFTER_SECONDS, math.ceil(held / self.worker.max_batch)))

    def limit_queue_time(self, generations: list[InFlight]) -> None:
        """End the request (all its choices) with a 503 and Retry-After if one of its choices
        has neither started decoding nor ended ``max_queue_time`` seconds from now. A stream has
        sent nothing by then (``server.py`` holds its 200 until it starts), so either way the
        client gets a plain 503, not a cut response."""
        limit = self.options.max_queue_time
        if limit is None or not generations:
            return
        reason = RetryLater(503, f"The request waited {limit:g} s (--max-queue-time) without starting: the server is "
                                 "overloaded. Retry after the seconds in the Retry-After header, or on another instance.",
                            code="queue_timeout", retry_after=MIN_RETRY_AFTER_SECONDS)

        def expire() -> None:
            if all(generation.settled.is_set() for generation in generations):
                return
            reason.retry_after = self.retry_after()  # as of now, not of the request's arrival
            for generation in generations:
                generation.stop(reason)

        timer = generations[0].loop.call_later(limit, expire)
        for generation in generations:
            generation.queue_timer = timer

    def max_prompt_tokens(self) -> int:
        """The most prompt tokens a request could have: the context less one new token, and what
        one sequence of the batch's KV pool holds."""
        return min(self.context_length - 1, self.worker.engine.target_cache.capacity_tokens() - 1)

    def _check_prompt_chars(self, prompt: str | list[dict[str, Any]], chat: bool) -> None:
        """Refuse a prompt whose text alone is too long to fit, from its length in characters,
        before tokenizing it (seconds of both cores for a prompt of megabytes): no token stands
        for more than ``longest_token_chars`` characters, so it has at least chars / that many
        tokens."""
        longest = self.longest_token_chars
        if longest is None:
            return
        if isinstance(prompt, str):
            chars = len(prompt)
        else:
            chars = sum(len(m["content"]) for m in prompt if isinstance(m.get("content"), str))
        # Unicode normalization before tokenizing may compose up to a few characters into one
        # (NFC: a Hangul syllable from three jamo, a letter with two marks): leave room for it.
        most = self.max_prompt_tokens()
        bound = most * longest * NORMALIZATION_SLACK
        if chars > bound:
            raise APIError(400, f"The prompt's text has {chars} characters, more than {most} tokens "
                                f"can hold (no token of this model stands for more than {longest} characters); "
                                "send a shorter prompt.", "messages" if chat else "prompt", "context_length_exceeded")

    def prepare(self, raw: bytes, chat: bool) -> ParsedRequest:
        """Parse, validate and tokenize a request body (CPU work: run it off the event loop).
        The returned request's prompt is token ids."""
        try:
            req = parse_request(_load_json(raw), chat, self.served_names, self.methods, k_max=self.decoder.config.k_max)
            try:
                # Tokenize and check the length here, so that a streaming request too gets a 4xx
                # rather than an error event after a 200.
                prompt = req.prompt
                if req.tools is not None and req.tools.parses_calls:
                    template = getattr(self.decoder.tokenizer, "chat_template", None) or ""
                    if OPEN not in template:
                        raise APIError(400, "This model's chat template has no <tool_call> markup, the only tool-call "
                                            "format this server reads; send the request without tools.", "tools")
                if prompt and isinstance(prompt[0], int):
                    prompt_ids = prompt
                else:
                    self._check_prompt_chars(prompt, chat)
                    tools = req.tools.in_prompt if req.tools is not None else None
                    prompt_ids = self.decoder.encode(prompt, chat, tools)
                vocab = self.decoder.target.config.vocab_size
                if any(not 0 <= t < vocab for t in prompt_ids):
                    raise APIError(400, f"Prompt token ids must lie in [0, {vocab}).", "prompt")
                room = self.context_length - len(prompt_ids)
                if not req.max_tokens_given and 0 < room < req.params.max_new_tokens:
                    # OpenAI's chat default is "up to the context": a default must not be a 400.
                    req.params = dataclasses.replace(req.params, max_new_tokens=room)
                self.decoder.check_request(prompt_ids, req.params)
                bias = req.params.logit_bias
                if bias and max(bias) >= vocab:
                    raise APIError(400, f"'logit_bias' names token {max(bias)}, past the vocabulary's {vocab} ids.",
                                   "logit_bias")
                self.worker.engine.check_request(len(prompt_ids), req.params, self.method_of(req), self.k_of(req))
            except SpecDecodeError as err:
                raise APIError(400, client_message(err), "messages" if chat else "prompt") from err
        except APIError:
            self.metrics.count("rejected")
            raise
        req.prompt, req.chat = prompt_ids, False
        return req

    def compile_grammar(self, req: ParsedRequest) -> None:
        """Compile the request's structured output, if it has one (a 400 naming its field when it
        cannot be compiled or followed: engine/grammar.py). Run it in ``grammar_waits``: the
        thread mostly waits for the compile process, and must not hold one of the threads that
        prepare requests without a grammar."""
        if req.params.structured is None:
            return
        try:
            req.grammar = self.decoder.grammars.compile(req.params.structured)
        except SpecDecodeError as err:
            self.metrics.count("rejected")
            raise APIError(400, client_message(err), req.structured_field) from err

    def track(self, generation: InFlight) -> None:
        self.inflight.add(generation)
        timeout = self.options.request_timeout
        if timeout is not None:
            reason = APIError(504, f"The request ran past this server's limit of {timeout:g} s (--request-timeout) and "
                                   "was stopped; ask for fewer tokens.", code="request_timeout", kind="server_error")
            generation.timer = generation.loop.call_later(timeout, generation.stop, reason)

    def untrack(self, generation: InFlight) -> None:
        generation.stop()  # a no-op when it finished; cancels it when its client left
        for timer in (generation.timer, generation.queue_timer):
            if timer is not None:
                timer.cancel()
        self.inflight.discard(generation)

    def end_all(self) -> None:
        """End every request in flight with the shutdown error (a stream's last events are that
        error and ``[DONE]``); from the event loop."""
        self.draining = True
        reason = APIError(503, "The server is shutting down; the request was stopped before it finished. Retry it "
                               "on another instance.", code="server_shutting_down", kind="server_error")
        for generation in list(self.inflight):
            generation.stop(reason)

    async def drain(self, timeout: float, poll: float = 0.05) -> None:
        """Take no new requests (the guard answers 503), give those in flight ``timeout``
        seconds, then end the rest: a stream gets a final error event and ``[DONE]``."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.inflight and loop.time() < deadline:
            await asyncio.sleep(poll)
        self.end_all()
        # Their responses end at once (the readers are woken); let the last events go out.
        flush_deadline = loop.time() + 2.0
        while self.inflight and loop.time() < flush_deadline:
            await asyncio.sleep(poll)


def default_max_waiting(worker: BatchWorker) -> int:
    """``--max-waiting``'s default: WAITING_PER_BATCH_SEAT x the batch, at least MIN_MAX_WAITING."""
    return max(MIN_MAX_WAITING, WAITING_PER_BATCH_SEAT * worker.max_batch)


def longest_token_chars(tokenizer: Any) -> int | None:
    """The most characters one token of ``tokenizer`` can stand for (None: not known). Read from
    the vocabulary's token strings, which never have fewer characters than their text (byte-level
    BPE writes each byte as a character, SentencePiece a byte it falls back to as <0xNN>)."""
    try:
        pieces = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - a tokenizer without a readable vocabulary gets no bound
        return None
    longest = max((len(piece) for piece in pieces), default=0)
    return longest or None


def _load_json(raw: bytes) -> Any:
    try:
        return json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError as err:
        raise APIError(400, "The request body is nested too deeply to parse; send a flat OpenAI request.") from err
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, NaN/Infinity
        raise APIError(400, f"The request body is not valid JSON: {err}.") from err


def _refuse_constant(name: str) -> Any:
    # Python's json reads NaN and Infinity, which JSON itself does not have.
    raise ValueError(f"{name} is not a JSON value")
