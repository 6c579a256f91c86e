"""``specdecode serve --ray``: the Ray Serve flags, and the command that runs the replicas
(``serving/ray.py``; docs/scaling.md)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from specdecode.errors import InvalidRequestError

if TYPE_CHECKING:
    from specdecode.serving.spec import ServerSpec

# Flags that mean something only with --ray, with their defaults (given without --ray: refused).
RAY_ONLY_FLAGS = {"replicas": None, "min_replicas": None, "max_replicas": None, "target_ongoing_requests": None,
                  "max_ongoing_requests": None, "cpus_per_replica": None, "ray_address": None}


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    from specdecode.cli.args import positive_float
    from specdecode.cli.train import non_negative_int, positive_int

    group = parser.add_argument_group("Ray Serve: several replicas behind one address (docs/scaling.md)")
    group.add_argument("--ray", action="store_true",
                       help='serve through Ray Serve: replicas of this server behind Ray\'s proxy and router, on '
                            '--host/--port (pip install "specdecode[ray]")')
    group.add_argument("--replicas", type=positive_int, default=None,
                       help="replicas, each with its own copy of the models (default 1; with autoscaling, the "
                            "number to start with)")
    group.add_argument("--min-replicas", type=non_negative_int, default=None,
                       help="autoscaling: fewest replicas (0 lets an idle server scale to none; the next request "
                            "then waits for a replica to load)")
    group.add_argument("--max-replicas", type=positive_int, default=None, help="autoscaling: most replicas")
    group.add_argument("--target-ongoing-requests", type=positive_float, default=None,
                       help="autoscaling: requests in flight per replica to aim at (default: Ray's, 2)")
    group.add_argument("--max-ongoing-requests", type=positive_int, default=None,
                       help="most requests one replica holds; the rest wait at Ray's router (default: --max-batch + 2)")
    group.add_argument("--cpus-per-replica", type=positive_int, default=None,
                       help="CPUs Ray reserves for each replica, and the threads its engine runs (default: this "
                            "machine's CPUs divided by --replicas, or by --max-replicas when autoscaling)")
    group.add_argument("--ray-address", default=None,
                       help="join this Ray cluster ('auto': the one `ray start` runs on this machine; default: "
                            "start a local one for this command)")


def refuse_ray_flags_without_ray(args: argparse.Namespace) -> None:
    given = [name for name, default in RAY_ONLY_FLAGS.items() if getattr(args, name) != default]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise InvalidRequestError(f"{flags} apply to Ray Serve: add --ray.")


def cmd_serve_ray(args: argparse.Namespace, spec: ServerSpec) -> int:
    try:
        from specdecode.serving.ray import RayOptions, run
    except ImportError as err:
        raise InvalidRequestError(f'`specdecode serve --ray` needs Ray Serve: pip install "specdecode[ray]" '
                                  f"({err}).") from err
    # RayOptions' errors name its parameters (min_replicas=3); the CLI shows them as flags (cli/args.py).
    options = RayOptions(replicas=args.replicas, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                         target_ongoing_requests=args.target_ongoing_requests,
                         max_ongoing_requests=args.max_ongoing_requests, cpus_per_replica=args.cpus_per_replica,
                         address=args.ray_address)
    run(spec, options, args.host, args.port)
    return 0
