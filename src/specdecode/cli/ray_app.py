"""Ray Serve applications from ``specdecode serve``'s flags, for Python and for Serve config
files (``serve run specdecode.cli.ray_app:app_builder ...``; docs/scaling.md). The deployment
itself is ``serving/ray.py``, which takes a ``ServerSpec`` and knows no flags."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from specdecode.errors import InvalidRequestError


def parse_serve_args(serve_args: Sequence[str] | str) -> argparse.Namespace:
    """``specdecode serve``'s flags (a list, or one string split as a shell would) as parsed flags."""
    from specdecode.cli.app import build_parser

    argv = shlex.split(serve_args) if isinstance(serve_args, str) else list(serve_args)
    try:
        args = build_parser().parse_args(["serve", *argv])
    except SystemExit as exit_:  # argparse has printed what was wrong
        raise InvalidRequestError(f"serve_args: not flags of `specdecode serve`: {argv}") from exit_
    if args.ray:
        raise InvalidRequestError("serve_args: --ray and the other Ray flags go in RayOptions, not serve_args.")
    return args


def build_app_from_flags(serve_args: Sequence[str] | str = (), options: Any = None) -> Any:
    """The Ray Serve application: ``options.replicas`` replicas (a ``serving.ray.RayOptions``) of
    ``specdecode serve`` with the flags ``serve_args`` (e.g. ``["--target", "path", "--method",
    "ngram"]``). Run it with ``serve.run(build_app_from_flags(...), route_prefix="/")``."""
    from specdecode.cli.serve import server_spec
    from specdecode.serving.ray import build_app

    return build_app(server_spec(parse_serve_args(serve_args)), options)


def app_builder(config: Mapping[str, Any]) -> Any:
    """For ``serve run`` and Serve config files (``import_path: specdecode.cli.ray_app:app_builder``):
    ``config`` holds ``serve_args`` (a list of flags or one string) and any ``RayOptions`` field."""
    from specdecode.serving.ray import RayOptions

    config = dict(config)
    serve_args = config.pop("serve_args", ())
    known = {f.name for f in fields(RayOptions)} - {"address"}
    unknown = sorted(set(config) - known)
    if unknown:
        raise InvalidRequestError(f"app_builder: unknown arguments {unknown}; give serve_args and any of "
                                  f"{sorted(known)}.")
    for name in ("replicas", "min_replicas", "max_replicas", "max_ongoing_requests", "cpus_per_replica"):
        if isinstance(config.get(name), str):  # `serve run ... replicas=2` passes strings
            config[name] = int(config[name])
    for name in ("target_ongoing_requests", "health_check_period_s", "health_check_timeout_s"):
        if isinstance(config.get(name), str):
            config[name] = float(config[name])
    return build_app_from_flags(serve_args, RayOptions(**config))
