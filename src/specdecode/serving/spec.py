"""What a server is built from, and building it: the decoder, the batch worker and the options
that ``specdecode serve`` serves (``cli/serve.py`` turns its flags into a ``ServerSpec``), and
that each Ray Serve replica builds again from the same spec (``serving/ray.py``).

A ``ServerSpec`` holds only plain, picklable configuration, so that Ray can send it to replicas
on other processes and machines; the models load where ``load_server`` runs."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from specdecode.config import DecoderConfig, SchedulerConfig
from specdecode.engine.batch import DEFAULT_BATCH_POLICY, DEFAULT_KV_CACHE_TOKENS, DEFAULT_MAX_BATCH
from specdecode.errors import InvalidRequestError
from specdecode.serving.state import ServerOptions

if TYPE_CHECKING:
    from specdecode.api import SpecDecoder
    from specdecode.serving.worker import BatchWorker


@dataclass(slots=True, frozen=True)
class ServerSpec:
    """decoder:         the decoder's configuration (models, method, k, ...).
    model_name:      the model id clients send (None: ``served_model_name`` of the target).
    max_batch:       requests decoded together by the continuous-batching engine, which decodes
                     every request (1: one at a time).
    kv_cache_tokens: the batch engine's KV pool, in tokens.
    batch_policy:    the batch's draft-length policy (``engine/batch.py: BATCH_POLICIES``).
    scheduling:      chunked prefill and time slices (``SchedulerConfig``).
    options:         the HTTP side: guard, timeouts, suffix sharing, connections, backpressure."""

    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    model_name: str | None = None
    max_batch: int = DEFAULT_MAX_BATCH
    kv_cache_tokens: int = DEFAULT_KV_CACHE_TOKENS
    batch_policy: str = DEFAULT_BATCH_POLICY
    scheduling: SchedulerConfig = field(default_factory=SchedulerConfig)
    options: ServerOptions = field(default_factory=ServerOptions)

    def __post_init__(self) -> None:
        # Checked before anything loads (and before Ray starts replicas): the server decodes every
        # request in the batch engine.
        if self.max_batch < 1:
            raise InvalidRequestError(f"--max-batch must be at least 1 (1 decodes one request at a time), got "
                                      f"{self.max_batch}.")


class ServerParts(NamedTuple):
    """What a ``ServerSpec`` builds: the process serves these (or each Ray Serve replica does)."""

    decoder: SpecDecoder
    model_name: str
    worker: BatchWorker
    options: ServerOptions


def served_model_name(target: str) -> str:
    """The model id a server answers to without ``--model-name``: a local folder's or file's
    name (its full path, echoed in every response and 404, would tell clients about the
    server's disk), or the hub id as given."""
    path = Path(target).expanduser()
    return path.resolve().name if path.exists() else target


def load_server(spec: ServerSpec) -> ServerParts:
    """Load the models and build the batch worker that ``spec`` asks for, telling the operator
    on stderr what takes time (timing the models, compiling, reading the vocabulary)."""
    from specdecode.api import SpecDecoder
    from specdecode.models import demo
    from specdecode.serving.worker import BatchWorker

    decoder = SpecDecoder.from_config(spec.decoder)
    config = decoder.config
    name = spec.model_name or served_model_name(config.target or demo.DEFAULT_TARGET)
    print(f"Timing the models for the batch's cost-aware draft length (max batch {spec.max_batch}) ...", file=sys.stderr)
    engine = decoder.batch_engine(max_batch=spec.max_batch, kv_cache_tokens=spec.kv_cache_tokens,
                                  policy=spec.batch_policy, scheduling=spec.scheduling)
    if config.compile:  # compiled (on CUDA, recorded) before the first request, not during it
        print("--compile: compiling the batch's passes ...", file=sys.stderr)
        seconds = decoder.warm_up_engine(engine)
        print(f"--compile: {decoder.compile_log.summary()}; {seconds:.1f} s", file=sys.stderr)
    worker = BatchWorker(engine)
    # Structured outputs and tool calls need the vocabulary in the grammar engine (about a second
    # for a 151k vocabulary): read it now rather than on the first such request.
    seconds = decoder.grammars.warm()
    if seconds is not None and seconds > 0.2:
        print(f"Read the tokenizer into the grammar engine for structured outputs ({seconds:.1f} s).", file=sys.stderr)
    return ServerParts(decoder, name, worker, spec.options)
