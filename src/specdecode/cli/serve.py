"""``specdecode serve``: load a decoder and serve it over HTTP (``serving/server.py``)."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from specdecode.cli.args import add_decoder_arguments, non_negative_float, positive_float

if TYPE_CHECKING:
    from specdecode.serving.spec import ServerSpec

API_KEY_ENV = "SPECDECODE_API_KEY"


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    from specdecode.cli.serve_ray import add_ray_arguments
    from specdecode.cli.train import non_negative_int, positive_int
    from specdecode.config import DEFAULT_PREFILL_CHUNK, DEFAULT_SPARE_SLOTS, DEFAULT_TIME_SLICE
    from specdecode.engine.batch import BATCH_POLICIES, DEFAULT_BATCH_POLICY, DEFAULT_KV_CACHE_TOKENS, DEFAULT_MAX_BATCH
    from specdecode.serving.guard import DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_BODY_BYTES
    from specdecode.serving.state import (
        DEFAULT_DRAIN_TIMEOUT,
        DEFAULT_HEADER_TIMEOUT,
        DEFAULT_KEEP_ALIVE_TIMEOUT,
        DEFAULT_MAX_CONNECTIONS,
        DEFAULT_MAX_QUEUE_TIME,
        MIN_MAX_WAITING,
        WAITING_PER_BATCH_SEAT,
    )
    from specdecode.serving.suffix_share import DEFAULT_SUFFIX_SHARE, SUFFIX_SHARES

    parser = sub.add_parser(
        "serve",
        help="serve the models over an OpenAI-compatible HTTP API",
        description=(
            "OpenAI-compatible /v1/completions and /v1/chat/completions (stream: true for server-sent "
            "events), /v1/models, /health and /metrics (Prometheus). Every request is batched (continuous "
            "batching, on torch and on llama.cpp), whatever its method. Listens on loopback unless --host "
            "says otherwise."
        ),
    )
    add_decoder_arguments(parser, exclude=frozenset({"engine"}), method_help="the default method; a request may pass 'method' (default draft; "
                          "see `specdecode generate --help` for each)")
    parser.add_argument("--model-name",
                        help="the name clients pass as 'model' (default: the target's folder or file name, or its hub id)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch", type=positive_int, default=DEFAULT_MAX_BATCH,
                        help="most requests decoded together, every method batched (1: one request at a time)")
    parser.add_argument("--kv-cache-tokens", type=positive_int, default=DEFAULT_KV_CACHE_TOKENS,
                        help="KV cache slots per model for the batch (torch: paged, requests wait or are preempted beyond it; "
                             "llama.cpp: split evenly over --max-batch sequences, --spare-slots more on top)")
    parser.add_argument("--batch-policy", choices=BATCH_POLICIES, default=DEFAULT_BATCH_POLICY,
                        help="async: each request keeps all it accepts; sync: a step keeps the batch's fewest")
    fair = parser.add_argument_group("fair scheduling of the batch (docs/design.md#fair-scheduling)")
    fair.add_argument("--prefill-chunk", type=non_negative_int, default=DEFAULT_PREFILL_CHUNK,
                      help="most prompt tokens prefilled in one step, so a long prompt does not stall the batch "
                           "(0: whole prompts at once)")
    fair.add_argument("--time-slice", type=non_negative_int, default=DEFAULT_TIME_SLICE,
                      help="decode steps a request keeps its batch seat before a waiting request served less may take "
                           "it (0: a full batch makes new requests wait for running ones to finish)")
    fair.add_argument("--spare-slots", type=non_negative_int, default=DEFAULT_SPARE_SLOTS,
                      help="llama.cpp: sequence slots beyond --max-batch that keep preempted requests' K/V "
                           "(0: no preemption for fairness on llama.cpp)")
    parser.add_argument("--suffix-share", choices=SUFFIX_SHARES, default=DEFAULT_SUFFIX_SHARE,
                        help="method suffix drafts from earlier responses of: the same API key (tenant), every "
                             "request (global), or none; sharing across users leaks through timing (docs/server.md)")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    limits = parser.add_argument_group("security and limits (docs/server.md#security-and-limits)")
    limits.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"require 'Authorization: Bearer KEY' on every route but /health (default: ${API_KEY_ENV}; "
                             "unset: no key)")
    limits.add_argument("--allowed-hosts", default="",
                        help="comma-separated Host names to answer to besides loopback ones and --host "
                             "(DNS-rebinding protection); '*' answers to any Host")
    limits.add_argument("--max-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest request body; larger ones get 413 (default: 2 MiB)")
    limits.add_argument("--request-timeout", type=positive_float, default=None,
                        help="seconds a request may run (queueing included) before it is stopped (default: no limit)")
    limits.add_argument("--drain-timeout", type=non_negative_float, default=DEFAULT_DRAIN_TIMEOUT,
                        help="on SIGTERM/SIGINT, seconds in-flight requests get to finish before they are ended")
    limits.add_argument("--keep-alive-timeout", type=positive_float, default=DEFAULT_KEEP_ALIVE_TIMEOUT,
                        help="seconds an idle keep-alive connection stays open (default: 5)")
    limits.add_argument("--header-timeout", type=positive_float, default=DEFAULT_HEADER_TIMEOUT,
                        help="seconds a client has to send a request's headers before its connection is closed "
                             "(default: 10)")
    limits.add_argument("--max-connections", type=non_negative_int, default=DEFAULT_MAX_CONNECTIONS,
                        help=f"connections and requests at once; past it new requests get 503 with Retry-After, but "
                             f"/health is answered (default: {DEFAULT_MAX_CONNECTIONS}; 0: no limit)")
    limits.add_argument("--body-timeout", type=non_negative_float, default=DEFAULT_BODY_TIMEOUT,
                        help=f"seconds a client has to send a request's body once its headers are in; then 408 and "
                             f"the connection is closed (default: {DEFAULT_BODY_TIMEOUT:g}; 0: no limit)")
    limits.add_argument("--max-waiting", type=positive_int, default=None,
                        help=f"requests that may wait for an engine (behind a full batch, or for the one-at-a-time "
                             f"engine) before new ones get 429 with Retry-After (default: {WAITING_PER_BATCH_SEAT} x "
                             f"--max-batch, at least {MIN_MAX_WAITING})")
    limits.add_argument("--max-queue-time", type=non_negative_float, default=DEFAULT_MAX_QUEUE_TIME,
                        help=f"seconds a request may wait without starting to decode; then 503 with Retry-After, "
                             f"streams included (default: {DEFAULT_MAX_QUEUE_TIME:g}; 0: no limit)")
    add_ray_arguments(parser)


def cmd_serve(args: argparse.Namespace) -> int:
    from specdecode.cli.serve_ray import cmd_serve_ray, refuse_ray_flags_without_ray
    from specdecode.errors import InvalidRequestError
    from specdecode.serving.spec import load_server

    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401

        from specdecode.serving.server import serve
    except ImportError as err:
        raise InvalidRequestError(f'`specdecode serve` needs the server extras: pip install "specdecode[serve]" ({err}).') from err
    if not 0 < args.port < 65536:
        raise InvalidRequestError(f"--port must be in 1..65535, got {args.port}.")
    spec = server_spec(args)
    if args.ray:
        return cmd_serve_ray(args, spec)
    refuse_ray_flags_without_ray(args)
    parts = load_server(spec)
    serve(parts.decoder, parts.model_name, args.host, args.port, parts.worker, log_level=args.log_level,
          options=parts.options)
    return 0


def server_spec(args: argparse.Namespace) -> ServerSpec:
    """The server that ``specdecode serve``'s flags describe (``serving/spec.py``); a Ray Serve
    replica builds the same from it."""
    from specdecode import DecoderConfig, SchedulerConfig
    from specdecode.serving.guard import GuardOptions, default_allowed_hosts
    from specdecode.serving.spec import ServerSpec
    from specdecode.serving.state import ServerOptions

    hosts = tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip())
    guard = GuardOptions(api_key=args.api_key or None, max_body_bytes=args.max_body_bytes,
                         allowed_hosts=default_allowed_hosts(args.host, hosts), body_timeout=args.body_timeout or None)
    options = ServerOptions(guard=guard, request_timeout=args.request_timeout, drain_timeout=args.drain_timeout,
                            suffix_share=args.suffix_share, keep_alive_timeout=args.keep_alive_timeout,
                            max_connections=args.max_connections or None, header_timeout=args.header_timeout,
                            max_waiting=args.max_waiting, max_queue_time=args.max_queue_time or None)
    scheduling = SchedulerConfig(prefill_chunk=args.prefill_chunk, time_slice=args.time_slice,
                                 spare_slots=args.spare_slots)
    return ServerSpec(decoder=DecoderConfig.from_args(args), model_name=args.model_name, max_batch=args.max_batch,
                      kv_cache_tokens=args.kv_cache_tokens, batch_policy=args.batch_policy, scheduling=scheduling,
                      options=options)
