"""`specdecode serve` on Ray Serve (serving/ray.py): a local Ray cluster with two replicas of the
tiny models behind Ray's proxy on a loopback port.

- the official openai client gets, from the replicas, what single-process generate() gives
  (greedy; completions and chat, streamed and not);
- both replicas serve, as their /metrics (a `replica` label) and Ray's metrics endpoint show;
- a replica killed (SIGKILL) under a bounded load: every request completes correctly or gets a
  clear error (a 503 or a final error event, code replica_unavailable), none hangs, Ray starts a
  new replica, and then every request completes;
- `specdecode serve --ray` joins the cluster, serves, and removes its application on SIGINT.

Marked `ray` (left out of the default run; `python -m pytest -m ray tests/serving` runs them, CI
does after installing `.[ray]`): starting Ray takes tens of seconds on a small machine.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import MESSAGES, MODEL, free_port, wait_for

from specdecode import SamplingParams
from specdecode.errors import InvalidRequestError

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
from specdecode.cli.ray_app import build_app_from_flags  # noqa: E402
from specdecode.serving.ray import (  # noqa: E402
    APP_NAME,
    DEPLOYMENT_NAME,
    PROXY_CALLBACK,
    PROXY_CALLBACK_ENV,
    RayOptions,
    SpecDecodeReplica,
)

pytestmark = pytest.mark.ray

SRC_DIR = Path(__file__).resolve().parents[2] / "src"
REPLICAS = 2
PROMPTS = ["def quicksort(arr):", "The quick brown fox", "class Counter:", "for i in range(10):"]
LOAD_REQUESTS, LOAD_CONCURRENCY, LOAD_MAX_TOKENS = 40, 4, 96
REQUEST_TIMEOUT_SECONDS = 60  # per request: a hung one fails the test instead of the run
RECOVERY_TIMEOUT_SECONDS = 180
KILL_ROUNDS = 3


def replica_pids() -> set[int]:
    """Process ids of this app's replicas (Ray titles each replica process after its deployment)."""
    title = f"ServeReplica:{APP_NAME}:{DEPLOYMENT_NAME}".encode()
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if title in cmdline:
                pids.add(int(entry))
    return pids


def cpu_ticks(pid: int) -> int:
    """User + system CPU time of a process so far, in clock ticks (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def busiest(pids: set[int], window: float = 0.3) -> int:
    """The process that used the most CPU over ``window`` seconds: a replica decoding a request
    burns CPU, an idle one does not (Ray's router may send every request of the moment to one
    replica, so killing an arbitrary one can kill no request)."""
    start = {pid: cpu_ticks(pid) for pid in pids}
    time.sleep(window)
    return max(pids, key=lambda pid: cpu_ticks(pid) - start[pid])


def running_replicas() -> int:
    status = serve.status().applications.get(APP_NAME)
    if status is None or DEPLOYMENT_NAME not in status.deployments:
        return 0
    return status.deployments[DEPLOYMENT_NAME].replica_states.get("RUNNING", 0)


def serve_flags(target: Path, draft: Path) -> list[str]:
    return ["--target", str(target), "--draft", str(draft), "--dtype", "fp32", "--device", "cpu",
            "--model-name", MODEL, "--max-batch", "4", "--kv-cache-tokens", "2048"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A local Ray cluster with Serve's proxy on a free loopback port; yields the proxy's URL."""
    # The workers import this checkout (as the tests do), and Serve's proxy loads our middleware.
    path = os.pathsep.join(p for p in (str(SRC_DIR), os.environ.get("PYTHONPATH", "")) if p)
    env = {PROXY_CALLBACK_ENV: PROXY_CALLBACK, "PYTHONPATH": path}
    ray.init(num_cpus=REPLICAS, include_dashboard=False, runtime_env={"env_vars": env},
             _system_config={"metrics_report_interval_ms": 1000})
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_served(cluster: str, tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> str:
    """Two replicas of `specdecode serve` over the tiny pair, health-checked every second."""
    options = RayOptions(replicas=REPLICAS, health_check_period_s=1.0)
    serve.run(build_app_from_flags(serve_flags(tiny_qwen2_dir, tiny_close_draft_dir), options), name=APP_NAME, route_prefix="/")
    wait_for(lambda: running_replicas() == REPLICAS, "the replicas did not start", timeout=120)
    return cluster


def client(base: str) -> openai.OpenAI:
    # No retries: the fault test counts what a client sees on its first try.
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_SECONDS)


def replica_counts(base: str, status: str = "ok", seconds: float = 30.0) -> dict[str, float]:
    """Requests with ``status`` per replica, from /metrics read through the proxy: each read
    answers from the replica the router picks, so read until every replica has answered.

    Reads for ``seconds`` rather than a number of times: Ray's router keeps each replica's queue
    length in a cache for 10 s (RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S) and sends every request
    to the replica with the shorter cached queue, so a stale entry left by the last burst of
    requests steers all reads to one replica until it expires (CI saw 60 reads in 2 s all land on
    one replica)."""
    counts: dict[str, float] = {}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
            if line.startswith("specdecode_requests_total{") and f'status="{status}"' in line:
                replica = line.split('replica="', 1)[1].split('"', 1)[0]
                counts[replica] = float(line.split()[-1])
        if len(counts) >= REPLICAS:
            break
        time.sleep(0.1)
    return counts


def test_deployment_options_follow_the_flags() -> None:
    """No cluster needed: what the replicas are deployed with."""
    from specdecode.cli.ray_app import parse_serve_args
    from specdecode.cli.serve import server_spec
    from specdecode.serving.ray import deployment_options

    args = server_spec(parse_serve_args("--max-batch 6 --drain-timeout 5"))
    fixed = deployment_options(RayOptions(replicas=3, cpus_per_replica=2), args)
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 2} and fixed["max_ongoing_requests"] == 6 + 2
    assert fixed["graceful_shutdown_timeout_s"] > 5
    cpus = len(os.sched_getaffinity(0))
    assert RayOptions(replicas=2).cpus == max(1, cpus // 2) and RayOptions().cpus == cpus
    assert RayOptions(min_replicas=1, max_replicas=2 * cpus).cpus == 1  # the most replicas share the CPUs
    scaling = deployment_options(RayOptions(min_replicas=0, max_replicas=4, target_ongoing_requests=3), args)
    assert "num_replicas" not in scaling
    assert scaling["autoscaling_config"] == {"min_replicas": 0, "max_replicas": 4, "initial_replicas": 1,
                                             "target_ongoing_requests": 3}
    with pytest.raises(InvalidRequestError, match="min_replicas"):
        RayOptions(min_replicas=5, max_replicas=2)
    with pytest.raises(InvalidRequestError, match="serve_args"):
        parse_serve_args(["--ray"])


def test_app_builder_takes_serve_run_arguments() -> None:
    """`serve run specdecode.cli.ray_app:app_builder replicas=2 serve_args='--method ngram'` passes strings."""
    from specdecode.cli.ray_app import app_builder

    app = app_builder({"replicas": "2", "serve_args": "--method ngram --max-batch 2"})
    deployment = app._bound_deployment
    assert deployment.num_replicas == 2 and deployment.max_ongoing_requests == 4
    assert deployment.init_args[0].decoder.method == "ngram"
    with pytest.raises(InvalidRequestError, match="unknown arguments"):
        app_builder({"replica": 2})


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin to one")
def test_a_replica_runs_its_threads_on_cpus_of_its_own() -> None:
    """limit_threads in a child process (it pins the whole process): one thread, on the CPU its
    rank picks, which is also what llama.cpp counts."""
    allowed = sorted(os.sched_getaffinity(0))
    code = ("import os, torch; from specdecode.serving.ray import limit_threads; limit_threads(1, 1); "
            "from specdecode.backends.llamacpp import physical_core_count; "
            "print(sorted(os.sched_getaffinity(0)), torch.get_num_threads(), physical_core_count())")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(SRC_DIR), os.environ.get("PYTHONPATH", "")) if p))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split("\n")[-2] == f"[{allowed[1]}] 1 1"


def test_the_health_check_hook_reads_the_engine(start_server) -> None:
    """Ray calls check_health on the replica; it raises (Ray replaces the replica) when the engine
    cannot serve. Called here on a bare server's state, without a cluster."""
    import asyncio
    from types import SimpleNamespace

    check = SpecDecodeReplica.func_or_class.check_health
    with start_server() as (_, state):
        replica = SimpleNamespace(state=state, replica="r0")
        asyncio.run(check(replica))  # healthy: returns
        state.worker.close()
        with pytest.raises(RuntimeError, match="replica r0: the batch engine's worker thread has stopped"):
            asyncio.run(check(replica))


def test_the_openai_client_gets_single_process_greedy_output(ray_served: str, tiny_decoder) -> None:
    cases = [(prompt, n, stream) for prompt in PROMPTS for n, stream in ((12, False), (16, True))]
    expected = {(p, n): tiny_decoder.generate(p, SamplingParams(max_new_tokens=n)).text for p, n, _ in cases}

    def ask(case: tuple[str, int, bool]) -> str:
        prompt, n, stream = case
        result = client(ray_served).completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                                       stream=stream)
        return "".join(c.choices[0].text for c in result) if stream else result.choices[0].text

    with ThreadPoolExecutor(4) as pool:  # at once, so that both replicas take some
        got = list(pool.map(ask, cases))
    assert got == [expected[(p, n)] for p, n, _ in cases]

    chat_expected = tiny_decoder.generate(MESSAGES, SamplingParams(max_new_tokens=10), chat=True).text
    chat = client(ray_served).chat.completions
    reply = chat.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0)
    assert reply.choices[0].message.content == chat_expected
    streamed = list(chat.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, stream=True,
                                extra_body={"method": "ngram"}))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat_expected
    assert [m.id for m in client(ray_served).models.list()] == [MODEL]
    assert httpx.get(ray_served + "/health").json() == {"status": "ok"}


def test_both_replicas_serve_as_their_metrics_show(ray_served: str, cluster: str) -> None:
    def ask(i: int) -> None:
        client(ray_served).completions.create(model=MODEL, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=8,
                                              temperature=0)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(ask, range(16)))
    counts = replica_counts(ray_served)
    assert len(counts) == REPLICAS and all(count > 0 for count in counts.values()), counts
    # Ray's metrics endpoint on the node: the same counters, per replica, as Prometheus reads them.
    node_port = ray.nodes()[0]["MetricsExportPort"]

    def exported() -> dict[str, float]:
        found = {}
        for line in httpx.get(f"http://127.0.0.1:{node_port}/metrics", timeout=10).text.splitlines():
            if line.startswith("ray_specdecode_requests_total{") and 'status="ok"' in line:
                found[line.split('replica="', 1)[1].split('"', 1)[0]] = float(line.split()[-1])
        return found

    wait_for(lambda: exported() == counts, f"Ray's metrics endpoint never matched /metrics {counts}", timeout=30)


def test_a_killed_replica_fails_only_its_requests_clearly_and_is_replaced(ray_served: str, tiny_decoder) -> None:
    expected = {p: tiny_decoder.generate(p, SamplingParams(max_new_tokens=LOAD_MAX_TOKENS)).text for p in PROMPTS}
    before = replica_pids()
    assert len(before) == REPLICAS, before

    def run_load(kill_after: int | None) -> tuple[dict[str, list], int | None]:
        """LOAD_REQUESTS requests, LOAD_CONCURRENCY at a time (every other one streamed); SIGKILL
        the busiest replica once ``kill_after`` have finished. Each outcome: ok, clear or
        unclear; and the killed pid."""
        outcomes: dict[str, list] = {"ok": [], "clear": [], "unclear": []}
        victim = None
        finished = threading.Semaphore(0)

        def ask(i: int) -> None:
            prompt, stream = PROMPTS[i % len(PROMPTS)], i % 2 == 1
            try:
                result = client(ray_served).completions.create(model=MODEL, prompt=prompt, temperature=0,
                                                               max_tokens=LOAD_MAX_TOKENS, stream=stream)
                text = "".join(c.choices[0].text for c in result) if stream else result.choices[0].text
                outcomes["ok" if text == expected[prompt] else "unclear"].append(i)
            except openai.APIError as err:  # a status error (503) or a stream's error event
                body = err.body if isinstance(err.body, dict) else {}
                body = body.get("error", body)
                clear = body.get("code") == "replica_unavailable" and "Retry the request" in err.message
                outcomes["clear" if clear else "unclear"].append((i, type(err).__name__, err.message[:200]))
            except Exception as err:  # a hang (timeout), a cut connection: what must not happen
                outcomes["unclear"].append((i, type(err).__name__, str(err)[:200]))
            finally:
                finished.release()

        with ThreadPoolExecutor(LOAD_CONCURRENCY) as pool:
            futures = [pool.submit(ask, i) for i in range(LOAD_REQUESTS)]
            if kill_after is not None:
                for _ in range(kill_after):
                    assert finished.acquire(timeout=REQUEST_TIMEOUT_SECONDS), "the load stalled before the kill"
                victim = busiest(replica_pids())
                os.kill(victim, signal.SIGKILL)
            deadline = time.time() + REQUEST_TIMEOUT_SECONDS * 2
            for future in futures:
                future.result(timeout=max(1.0, deadline - time.time()))  # nothing hangs
        return outcomes, victim

    def replaced(victim: int) -> bool:
        pids = replica_pids()
        return running_replicas() == REPLICAS and len(pids) == REPLICAS and victim not in pids

    # A kill between two requests proves nothing; the busiest replica almost always holds one,
    # and a round that caught none is run again (at most KILL_ROUNDS), each after Ray's restart.
    for round_ in range(1, KILL_ROUNDS + 1):
        during, victim = run_load(kill_after=10)
        counts = {name: len(items) for name, items in during.items()}
        kinds = [("stream" if i % 2 else "request", kind) for i, kind, _ in during["clear"]]
        print(f"\nfault test round {round_}, {LOAD_REQUESTS} requests at {LOAD_CONCURRENCY} concurrent, "
              f"replica {victim} killed: {counts}; clear errors: {kinds}")
        assert not during["unclear"], during["unclear"]
        assert counts["ok"] + counts["clear"] == LOAD_REQUESTS
        wait_for(lambda: replaced(victim), "Ray did not replace the killed replica", timeout=RECOVERY_TIMEOUT_SECONDS)
        if counts["clear"]:
            break
    else:
        pytest.fail(f"in {KILL_ROUNDS} rounds the killed replica never held a request: the test proved nothing")

    after, _ = run_load(kill_after=None)
    print(f"after the restart: { {name: len(items) for name, items in after.items()} }")
    assert len(after["ok"]) == LOAD_REQUESTS, after
    assert len(replica_counts(ray_served)) == REPLICAS


def test_the_cli_joins_the_cluster_serves_and_stops_on_sigint(ray_served: str, cluster: str, tiny_qwen2_dir: Path,
                                                              tiny_close_draft_dir: Path, tiny_decoder,
                                                              tmp_path: Path) -> None:
    """`specdecode serve --ray --ray-address ...` (last: it replaces the fixture's application,
    which has the same name, and Serve's proxy keeps the port it was started with)."""
    address = ray.get_runtime_context().gcs_address
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(SRC_DIR), os.environ.get("PYTHONPATH", "")) if p))
    log_path = tmp_path / "serve.log"
    port = int(cluster.rsplit(":", 1)[1])
    command = [sys.executable, "-c", "import sys; from specdecode.cli import main; sys.exit(main())", "serve",
               "--ray", "--ray-address", address, "--replicas", "1", "--cpus-per-replica", "1", "--port", str(port),
               "--method", "ngram",
               *serve_flags(tiny_qwen2_dir, tiny_close_draft_dir)]
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for(lambda: proc.poll() is None and "Ctrl-C to stop" in log_path.read_text(),
                 f"the CLI did not start serving:\n{log_path.read_text()}", timeout=120)
        wait_for(lambda: running_replicas() == 1, "the CLI's application did not replace the fixture's", timeout=60)
        reply = client(cluster).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0)
        assert reply.choices[0].text == tiny_decoder.generate(PROMPTS[0], SamplingParams(max_new_tokens=12)).text
        assert reply.model_extra["specdecode"]["method"] == "ngram"  # the CLI's --method reached the replica
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0, log_path.read_text()
        assert APP_NAME not in serve.status().applications  # deleted; the cluster, which it joined, runs on
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_cli_says_why_the_replicas_did_not_start(ray_served: str, cluster: str, tmp_path: Path) -> None:
    """A replica that cannot be built (here: no such model file) fails the command with the
    replica's own error, not Ray's "failed to update the deployments", and leaves no application."""
    address = ray.get_runtime_context().gcs_address
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(SRC_DIR), os.environ.get("PYTHONPATH", "")) if p))
    command = [sys.executable, "-c", "import sys; from specdecode.cli import main; sys.exit(main())", "serve",
               "--ray", "--ray-address", address, "--target", str(tmp_path / "missing.gguf"), "--method", "none"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "replicas did not start: Model file" in done.stderr and "does not exist" in done.stderr
    assert APP_NAME not in serve.status().applications
