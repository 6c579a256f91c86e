"""``specdecode serve``: load a decoder and serve it over HTTP (``server.py``)."""

from __future__ import annotations

import argparse

from .runtime import DEVICE_CHOICES, DTYPE_CHOICES


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    from .cache import KV_DTYPES
    from .config import DEFAULT_NUM_SPECULATIVE_TOKENS, METHODS
    from .quant.apply import QUANT_CHOICES

    parser = sub.add_parser(
        "serve",
        help="serve the models over an OpenAI-compatible HTTP API",
        description=(
            "OpenAI-compatible /v1/completions and /v1/chat/completions (stream: true for server-sent "
            "events), /v1/models, /health and /metrics (Prometheus). Requests are decoded one at a "
            "time, in arrival order. Listens on loopback unless --host says otherwise."
        ),
    )
    parser.add_argument("--target", help="the model whose output is reproduced (default: demo 1.5B)")
    parser.add_argument("--draft", help="the draft model (default: demo 0.5B with the demo target)")
    parser.add_argument("--method", choices=METHODS, default="draft", help="default method; a request may pass 'method'")
    parser.add_argument("--k", type=int, default=DEFAULT_NUM_SPECULATIVE_TOKENS, help="tokens drafted per step")
    parser.add_argument("--heads", help="medusa/eagle heads folder (from `specdecode train`)")
    parser.add_argument("--tree-size", type=int, default=None, help="medusa/eagle: drafted tree nodes per step")
    parser.add_argument("--model-name", help="the name clients pass as 'model' (default: the target's name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", choices=list(DTYPE_CHOICES), default="auto")
    parser.add_argument("--device", choices=DEVICE_CHOICES, default="auto")
    parser.add_argument("--target-quant", choices=QUANT_CHOICES, default="none")
    parser.add_argument("--draft-quant", choices=QUANT_CHOICES, default="none")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def cmd_serve(args: argparse.Namespace) -> int:
    from . import SpecDecoder
    from .errors import InvalidRequestError
    from .models import demo

    try:
        from .server import serve
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise InvalidRequestError(f'`specdecode serve` needs the server extras: pip install "specdecode[serve]" ({err}).') from err
    if not 0 < args.port < 65536:
        raise InvalidRequestError(f"--port must be in 1..65535, got {args.port}.")
    decoder = SpecDecoder.from_pretrained(
        args.target, args.draft, method=args.method, k=args.k, heads=args.heads, tree_size=args.tree_size,
        dtype=args.dtype, device=args.device, target_quant=args.target_quant, draft_quant=args.draft_quant,
        kv_dtype=args.kv_dtype,
    )
    name = args.model_name or (args.target or demo.DEFAULT_TARGET)
    serve(decoder, name, args.host, args.port, log_level=args.log_level)
    return 0
