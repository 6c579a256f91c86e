"""Aggregate throughput of `specdecode serve` alone and on Ray Serve with replicas x threads.

    python benchmarks/bench_replicas.py --configs serve,1x2,2x1,2x2 --methods draft --concurrency 4 \
        --requests 8 --max-tokens 48 --out benchmarks/results/ray-replicas/replicas.json

Each config serves the same flags (``--serve-args``; default: the demo pair, method draft, backend
auto) on a loopback port and is driven by ``load_test.py``'s levels (streaming chat requests,
greedy, ``--concurrency`` at a time): ``serve`` is one ``specdecode serve`` process; ``RxT`` is R
Ray Serve replicas with ``cpus_per_replica`` T (T threads each; a replica is pinned to T CPUs
when the machine has more), all in one local Ray cluster started with enough logical CPUs for
the largest config (more than the machine has, to time oversubscription too). It prints and
writes tokens/s, latency percentiles, how the requests split over the replicas, and the load
average before and after each config (other work on the machine skews the figures).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_test import run_level  # noqa: E402

START_TIMEOUT_SECONDS = 600


def wait_healthy(base: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + START_TIMEOUT_SECONDS
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not start")


def replica_split(base: str) -> dict[str, float]:
    """Finished requests per replica, from /metrics (each read answers from one replica)."""
    counts: dict[str, float] = {}
    for _ in range(40):
        for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
            if line.startswith("specdecode_requests_total{") and 'status="ok"' in line:
                name = line.split('replica="', 1)[1].split('"', 1)[0] if 'replica="' in line else "serve"
                counts[name] = float(line.split()[-1])
    return counts


def drive(base: str, args: argparse.Namespace) -> list[dict]:
    model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
    rows = []
    for level in [int(c) for c in args.concurrency.split(",")]:
        for method in args.methods.split(","):
            row = asyncio.run(run_level(base, model, method, level, max(args.requests, level), args.max_tokens))
            for key in ("_ttfts", "_gaps"):
                row.pop(key)
            rows.append(row)
            print(f"  {method:>6} c={level}: {row['completed']}/{row['requests']} ok, "
                  f"{row['tokens_per_second']:.2f} tok/s, TTFT p50 {row['ttft_seconds']['p50']:.2f} s", flush=True)
    return rows


def run_serve(args: argparse.Namespace, port: int) -> tuple[list[dict], dict[str, float]]:
    base = f"http://127.0.0.1:{port}"
    command = ["specdecode", "serve", "--port", str(port), "--log-level", "warning", *shlex.split(args.serve_args)]
    proc = subprocess.Popen(command)
    try:
        wait_healthy(base, proc)
        return drive(base, args), replica_split(base)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


def run_ray(args: argparse.Namespace, port: int, replicas: int, threads: int) -> tuple[list[dict], dict[str, float]]:
    from ray import serve

    from specdecode.cli.ray_app import build_app_from_flags
    from specdecode.serving.ray import APP_NAME, RayOptions

    base = f"http://127.0.0.1:{port}"
    serve.run(build_app_from_flags(args.serve_args, RayOptions(replicas=replicas, cpus_per_replica=threads)), name=APP_NAME,
              route_prefix="/")
    try:
        wait_healthy(base)
        return drive(base, args), replica_split(base)
    finally:
        serve.delete(APP_NAME)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="serve,1x2,2x1,2x2", help="serve and/or RxT (replicas x threads)")
    parser.add_argument("--serve-args", default="", help="flags of `specdecode serve` for every config")
    parser.add_argument("--methods", default="draft")
    parser.add_argument("--concurrency", default="4")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    ray_configs = [tuple(int(x) for x in c.split("x")) for c in configs if c != "serve"]
    results = []
    started = False
    try:
        for config in configs:
            load_before = os.getloadavg()
            print(f"{config} (load average {load_before[0]:.2f}):", flush=True)
            if config == "serve":
                rows, split = run_serve(args, args.port)
            else:
                if not started:
                    import ray
                    from ray import serve

                    from specdecode.serving.ray_proxy import PROXY_CALLBACK, PROXY_CALLBACK_ENV

                    cpus = max(r * t for r, t in ray_configs)
                    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False,
                             runtime_env={"env_vars": {PROXY_CALLBACK_ENV: PROXY_CALLBACK}})
                    serve.start(http_options={"host": "127.0.0.1", "port": args.port + 1})
                    started = True
                replicas, threads = (int(x) for x in config.split("x"))
                rows, split = run_ray(args, args.port + 1, replicas, threads)
            results.append({"config": config, "rows": rows, "requests_per_replica": split,
                            "load_average_before": load_before, "load_average_after": os.getloadavg()})
            print(f"  requests per replica: {split}; load average after {os.getloadavg()[0]:.2f}", flush=True)
            write(args, results)  # after every config: a run cut short keeps what it measured
    finally:
        if started:
            import ray
            from ray import serve

            serve.shutdown()
            ray.shutdown()
    return 0


def write(args: argparse.Namespace, results: list[dict]) -> None:
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "cpu_count": os.cpu_count(), "results": results},
                                             indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
