"""``specdecode serve`` on Ray Serve: replicas of the same server behind Ray's proxy and router.

Each replica is a Ray Serve deployment replica (a Ray actor) that builds exactly what
``specdecode serve`` builds from the same ``ServerSpec`` (``serving/spec.py:load_server``): the
decoder, the batch worker and the FastAPI app with its guard, served through Ray Serve's ASGI
ingress. Ray's
HTTP proxy takes the requests on ``--host``/``--port`` and Ray's default request router sends
each to one replica, picking the less loaded of two random replicas (power of two choices on
their queue lengths). OpenAI routes, streaming and errors are the single server's.

Routing has no prefix affinity, for two reasons: a replica keeps no KV cache between requests
(the batch engine frees a request's blocks when it ends), so no replica holds a prompt's prefix
to be routed to; and Ray's ``PrefixCacheAffinityRouter`` reads ``prompt``/``messages`` off the
arguments of a deployment-handle call, which an HTTP request sent to an ASGI ingress is not (its
body streams to the replica after routing).

Health: Ray calls each replica's ``check_health`` every ``health_check_period_s`` seconds; it
fails when the engine cannot serve (``serving/health.py``), and Ray then replaces the replica. A
replica whose process dies is replaced too; the requests it held fail with a clear 503 or a
final error event (``serving/ray_proxy.py``), and the others go on. Metrics: each replica's
``/metrics`` carries a ``replica`` label, and the same series go to Ray's metrics system
(``serving/ray_metrics.py``), where Prometheus scrapes every node. docs/scaling.md has the rest.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

try:
    import ray
    from ray import serve
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(f'specdecode.serving.ray needs Ray Serve: pip install "specdecode[ray]" ({err})') from err

from specdecode.errors import InvalidRequestError
from specdecode.serving.health import engine_problem
from specdecode.serving.ray_metrics import RayMetricsExporter
from specdecode.serving.ray_proxy import PROXY_CALLBACK, PROXY_CALLBACK_ENV

if TYPE_CHECKING:
    from specdecode.serving.spec import ServerSpec

__all__ = ["RayOptions", "SpecDecodeReplica", "build_app", "run"]

APP_NAME = "specdecode"
DEPLOYMENT_NAME = "SpecDecodeReplica"
# A replica that cannot be built (a wrong model path, a flag the model does not support) fails
# the same way every time: retry once, for a transient failure, not Ray's default 20 times, each
# of which loads the models again.
CONSTRUCTOR_RETRIES = 1
# Requests a replica holds beyond a full batch: enough that a finished request's slot is taken at
# once. Beyond them requests wait at the router, where a replica's death does not fail them.
EXTRA_ONGOING_REQUESTS = 2
FLUSH_SECONDS = 3.0  # after the drain, for the ended responses' last events to go out


@dataclass(slots=True, frozen=True)
class RayOptions:
    """How many replicas, how each is sized and checked, and which Ray cluster runs them.

    replicas:                 replicas to run (with autoscaling, how many to start with).
    min_replicas/max_replicas: autoscaling bounds; giving either turns autoscaling on.
    target_ongoing_requests:  autoscaling aims at this many requests in flight per replica
                              (None: Ray's default, 2).
    max_ongoing_requests:     the most requests a replica holds; more wait at Ray's router
                              (None: the batch size plus EXTRA_ONGOING_REQUESTS).
    cpus_per_replica:         CPUs Ray reserves for each replica, and the threads its engine
                              uses (torch's, and llama.cpp's through the CPUs it may run on);
                              None: this machine's CPUs shared among the replicas (the most
                              replicas, with autoscaling), at least 1.
    address:                  the Ray cluster to join ("auto": the one ``ray start`` runs on
                              this machine); None starts a local one.
    """

    replicas: int | None = None
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    max_ongoing_requests: int | None = None
    cpus_per_replica: int | None = None
    address: str | None = None
    app_name: str = APP_NAME
    health_check_period_s: float = 10.0
    health_check_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("replicas", "max_replicas", "max_ongoing_requests", "cpus_per_replica"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidRequestError(f"{name}={value} is too small: give at least 1.")
        if self.min_replicas is not None and self.min_replicas < 0:
            raise InvalidRequestError(f"min_replicas={self.min_replicas} is negative: give 0 or more.")
        if self.target_ongoing_requests is not None and not self.target_ongoing_requests > 0:
            raise InvalidRequestError(f"target_ongoing_requests={self.target_ongoing_requests} must be positive.")
        if self.target_ongoing_requests is not None and not self.autoscaling:
            raise InvalidRequestError("target_ongoing_requests= applies to autoscaling: give min_replicas= or "
                                      "max_replicas= too.")
        if self.autoscaling:
            low, high, start = self.bounds
            if not low <= high:
                raise InvalidRequestError(f"min_replicas={low} must not exceed max_replicas={high}.")
            if not low <= start <= high:
                raise InvalidRequestError(f"replicas={start} must lie between min_replicas={low} and "
                                          f"max_replicas={high} when autoscaling.")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    @property
    def cpus(self) -> int:
        """``cpus_per_replica``, or its default: the CPUs this process may use, shared among the
        replicas (a cluster's machines may differ from this one: give it there)."""
        if self.cpus_per_replica is not None:
            return self.cpus_per_replica
        most = self.bounds[1] if self.autoscaling else (self.replicas or 1)
        return max(1, len(os.sched_getaffinity(0)) // most)

    @property
    def bounds(self) -> tuple[int, int, int]:
        """(min, max, initial) replicas under autoscaling."""
        low = self.min_replicas if self.min_replicas is not None else 1
        start = self.replicas if self.replicas is not None else max(low, 1)
        high = self.max_replicas if self.max_replicas is not None else max(low, start)
        return low, high, start


def deployment_options(options: RayOptions, spec: ServerSpec) -> dict[str, Any]:
    """The Ray Serve deployment options for ``options`` and the server's spec."""
    ongoing = options.max_ongoing_requests or max(spec.max_batch, 1) + EXTRA_ONGOING_REQUESTS
    config: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "ray_actor_options": {"num_cpus": options.cpus},
        "max_ongoing_requests": ongoing,
        "health_check_period_s": options.health_check_period_s,
        "health_check_timeout_s": options.health_check_timeout_s,
        # Ray waits this long for a stopping replica's requests, then ends the process; streams
        # still open then end with an error event (serving/ray_proxy.py).
        "graceful_shutdown_timeout_s": spec.options.drain_timeout + FLUSH_SECONDS,
        "max_constructor_retry_count": CONSTRUCTOR_RETRIES,
    }
    if options.autoscaling:
        low, high, start = options.bounds
        scaling: dict[str, Any] = {"min_replicas": low, "max_replicas": high, "initial_replicas": start}
        if options.target_ongoing_requests is not None:
            scaling["target_ongoing_requests"] = options.target_ongoing_requests
        config["autoscaling_config"] = scaling
    else:
        config["num_replicas"] = options.replicas or 1
    return config


def limit_threads(threads: int, local_rank: int | None) -> None:
    """Run this replica's engine on ``threads`` CPUs. Ray reserves CPUs but does not pin them, and
    both torch and llama.cpp would otherwise size their pools to the whole machine, so two
    replicas on two cores would each run two threads and fight. When the process may use more
    CPUs than its share, pin it to ``threads`` of them, chosen by its rank on the node so that
    replicas there take different CPUs: llama.cpp counts the CPUs it may use
    (backends/llamacpp.py:physical_core_count)."""
    import torch

    torch.set_num_threads(threads)
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: no pinning
        return
    if len(allowed) <= threads:
        return
    first = (local_rank or 0) * threads
    chosen = {allowed[(first + i) % len(allowed)] for i in range(threads)}
    for task in os.listdir("/proc/self/task"):  # every thread: Ray's own ones were started already
        try:
            os.sched_setaffinity(int(task), chosen)
        except OSError:  # a thread that ended meanwhile
            pass


@serve.deployment
@serve.ingress()
class SpecDecodeReplica:
    """One replica: the decoder, batch worker and FastAPI app that ``specdecode serve`` builds from
    ``spec``."""

    def __init__(self, spec: ServerSpec, threads: int) -> None:
        from specdecode.serving.server import create_app
        from specdecode.serving.spec import load_server

        context = serve.get_replica_context()
        self.replica = context.replica_tag
        rank = getattr(context, "rank", None)
        limit_threads(threads, getattr(rank, "local_rank", None))
        parts = load_server(spec)
        self._server_app = create_app(parts.decoder, parts.model_name, worker=parts.worker, options=parts.options)
        self.state = self._server_app.state.specdecode
        self.state.metrics.labels["replica"] = self.replica
        self.exporter = RayMetricsExporter(self.state.metrics)

    def __serve_build_asgi_app__(self) -> Any:
        return self._server_app

    async def check_health(self) -> None:
        """Ray Serve's health check: raising marks this replica unhealthy, and Ray replaces it."""
        problem = engine_problem(self.state.worker)
        if problem is not None:
            raise RuntimeError(f"replica {self.replica}: {problem}")

    async def __del__(self) -> None:
        # Ray has waited for the requests in flight (up to graceful_shutdown_timeout_s): end any
        # left, so that their streams close with an error event, then stop the engine's thread.
        if not hasattr(self, "exporter"):  # the constructor failed (Ray reports why)
            return
        await self.state.drain(0.0)
        self.exporter.close()
        if self.state.worker is not None:
            await asyncio.to_thread(self.state.worker.close)


def build_app(spec: ServerSpec, options: RayOptions | None = None) -> Any:
    """The Ray Serve application: ``options.replicas`` replicas of the server ``spec`` describes.
    Run it with ``serve.run(build_app(...), route_prefix="/")``. From ``specdecode serve``'s flags:
    ``cli/ray_app.py`` (``build_app_from_flags``, and ``app_builder`` for Serve config files)."""
    options = options or RayOptions()
    deployment = SpecDecodeReplica.options(**deployment_options(options, spec))
    return deployment.bind(spec, options.cpus)


def connect(options: RayOptions) -> bool:
    """Start or join the Ray cluster; True when this process started it. Serve's HTTP proxies
    started from here load ``serving/ray_proxy.py`` (the variable reaches them through this job's
    runtime environment)."""
    started = options.address is None and not ray.is_initialized()
    if not ray.is_initialized():
        ray.init(address=options.address, runtime_env={"env_vars": {PROXY_CALLBACK_ENV: PROXY_CALLBACK}})
    return started


def run(spec: ServerSpec, options: RayOptions, host: str, port: int) -> None:
    """``specdecode serve --ray``: deploy the replicas, print where they listen, serve until
    SIGINT or SIGTERM, then delete the application (and stop the cluster this process started).
    Ray's proxy listens on ``host``/``port``."""
    started = connect(options)
    try:
        serve.start(http_options={"host": host, "port": port})
        app = build_app(spec, options)
        try:
            serve.run(app, name=options.app_name, route_prefix="/", blocking=False)
        except Exception as err:  # a replica that cannot be built (a wrong path, a bad flag)
            reason = _deploy_failure(options.app_name, err)
            serve.delete(options.app_name)  # leave no failed application on a cluster we joined
            raise InvalidRequestError(f"The Ray Serve replicas did not start: {reason}") from err
        replicas = "autoscaling {}..{} replicas".format(*options.bounds[:2]) if options.autoscaling else \
            f"{options.replicas or 1} replica(s)"
        print(f"specdecode serve --ray: {replicas} on http://{host}:{port}/v1 "
              f"(Ray cluster: {ray.get_runtime_context().gcs_address}); Ctrl-C to stop.", file=sys.stderr, flush=True)
        _wait_for_signal()
        print("Stopping: replicas finish their requests (up to --drain-timeout) ...", file=sys.stderr, flush=True)
        serve.delete(options.app_name)
    finally:
        if started:
            serve.shutdown()
            ray.shutdown()


def _deploy_failure(app_name: str, err: Exception) -> str:
    """Why the replicas did not start: the specdecode error a replica raised, found in the
    deployment's status (Ray's own exception only says that the deployment failed)."""
    try:
        status = serve.status().applications[app_name].deployments[DEPLOYMENT_NAME].message
    except Exception:  # no status to read: Ray's message is all there is
        return str(err)
    ours = re.findall(r"specdecode\.errors\.\w+: (.+)", status)
    return ours[-1] if ours else (status.strip().splitlines() or [str(err)])[-1]


def _wait_for_signal() -> None:
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(1.0):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
