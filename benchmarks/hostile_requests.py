"""Issue 49's hostile requests against a fresh `specdecode serve`: each row's answer, the server's
memory throughout, /health between cases, a plain completion's latency during 8 heavy compiles,
64 requests at once against a bounded queue, and 200 distinct schemas.

Loopback only, a fixed number of requests, stops by itself. It starts the server (the flags
after ``--`` go to ``specdecode serve``) and samples the resident memory of the server and of
its children (the grammar compile process) every 0.1 s:

    python benchmarks/hostile_requests.py --out benchmarks/results/hostile-llamacpp.json \
        -- --backend llama.cpp --method auto --max-waiting 16
    python benchmarks/hostile_requests.py --out benchmarks/results/hostile-torch.json \
        -- --backend torch --method auto --max-waiting 16

Rows (issue 49): 1 a grammar with no finite string; 2 a required tool whose parameters contain
themselves; 3 grammars whose language is empty; 4 lone surrogates in a tool's description and a
call's arguments; 5 nested repetition counts; 6 a 2-token plain completion while 8 requests
compile ``.{0,1000}zN`` (against its idle latency); 7 200 distinct JSON schemas (RSS growth);
8 a body sent at 1 byte a second; 9 the same key with another ``cache_salt`` (suffix drafts);
10 64 requests at once (each completes whole, or is refused within 1 s with Retry-After).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from specdecode.core.device import resident_bytes

MODEL = "demo"
START_TIMEOUT_SECONDS = 600
SAMPLE_SECONDS = 0.1
SELF_REQUIRED = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
CHAT = [{"role": "user", "content": "Write a function that adds two numbers."}]


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    if int(stat.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return found


class MemoryWatch(threading.Thread):
    """The server's resident memory, and its children's, every SAMPLE_SECONDS."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.samples, self.stop = pid, [], threading.Event()

    def run(self) -> None:
        while not self.stop.wait(SAMPLE_SECONDS):
            server = resident_bytes(self.pid) or 0
            self.samples.append((time.monotonic(), server, sum(resident_bytes(c) or 0 for c in children(self.pid))))

    def now(self) -> tuple[int, int]:
        return (self.samples[-1][1], self.samples[-1][2]) if self.samples else (resident_bytes(self.pid) or 0, 0)

    def peak_since(self, since: float) -> tuple[int, int]:
        window = [s for s in self.samples if s[0] >= since] or self.samples[-1:]
        return max(s[1] for s in window), max(s[1] + s[2] for s in window)


def post(base: str, body: dict, chat: bool = True, timeout: float = 300, headers: dict | None = None) -> httpx.Response:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": MODEL, "max_tokens": 16, "temperature": 0, **body}
    if chat:
        body.setdefault("messages", CHAT)
    else:
        body.setdefault("prompt", "def add(a, b):")
    # Encoded here: JSON escapes (\ud800) carry lone surrogates, which httpx's own encoder refuses.
    return httpx.post(base + path, content=json.dumps(body).encode(), timeout=timeout,
                      headers={"content-type": "application/json", **(headers or {})})


def summary(response: httpx.Response) -> dict[str, Any]:
    out: dict[str, Any] = {"status": response.status_code}
    try:
        payload = response.json()
    except ValueError:
        return out
    if "error" in payload:
        out["param"] = payload["error"].get("param")
        out["message"] = payload["error"].get("message", "")[:160]
    elif payload.get("choices"):
        out["finish_reason"] = payload["choices"][0].get("finish_reason")
        out["tau"] = payload.get("specdecode", {}).get("tau") if isinstance(payload.get("specdecode"), dict) else None
    return out


def slow_body(base: str, seconds: float) -> dict[str, Any]:
    """A request whose body arrives at 1 byte a second: the status and when it came."""
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=seconds) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode())
        sock.settimeout(1.0)
        reply = b""
        for byte in body:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            try:
                chunk = sock.recv(4096)
                if chunk:
                    reply += chunk
                    break
            except TimeoutError:
                pass
            if time.monotonic() - started > seconds:
                break
    status = int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/") else None
    return {"status": status, "seconds": round(time.monotonic() - started, 1)}


def crowd(base: str, count: int) -> dict[str, Any]:
    """``count`` streamed requests at once: each completes whole (a [DONE] after a final chunk), or
    is refused (429/503 with Retry-After) within 1 s."""

    def one(i: int) -> dict[str, Any]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Count from {i} to {i + 5}."}],
                "max_tokens": 16, "temperature": 0, "stream": True}
        started = time.monotonic()
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=600) as response:
            text = response.read().decode()
            seconds = time.monotonic() - started
            if response.status_code != 200:
                return {"status": response.status_code, "seconds": seconds,
                        "retry_after": response.headers.get("retry-after")}
        done = text.rstrip().endswith("data: [DONE]") and '"finish_reason"' in text and '"error"' not in text
        return {"status": 200, "seconds": seconds, "whole": done}

    with ThreadPoolExecutor(count) as pool:
        results = list(pool.map(one, range(count)))
    refused = [r for r in results if r["status"] != 200]
    served = [r for r in results if r["status"] == 200]
    return {
        "served": len(served), "served_whole": sum(r["whole"] for r in served),
        "refused": len(refused), "refused_statuses": sorted({r["status"] for r in refused}),
        "refused_with_retry_after": sum(r["retry_after"] is not None for r in refused),
        "refused_slowest_seconds": round(max((r["seconds"] for r in refused), default=0.0), 2),
        "served_slowest_seconds": round(max((r["seconds"] for r in served), default=0.0), 1),
    }


def plain_latency(base: str, repeats: int = 3) -> list[float]:
    times = []
    for _ in range(repeats):
        started = time.monotonic()
        reply = post(base, {"max_tokens": 2, "method": "none"}, chat=False)
        assert reply.status_code == 200, reply.text
        times.append(time.monotonic() - started)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--port", type=int, default=8077)
    parser.add_argument("--schemas", type=int, default=200)
    parser.add_argument("--rows", default="1,2,3,4,5,6,7,8,9,10", help="comma-separated rows to run (default: all)")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: flags for specdecode serve")
    args = parser.parse_args()
    serve_args = [a for a in args.serve_args if a != "--"]
    base = f"http://127.0.0.1:{args.port}"
    command = ["specdecode", "serve", "--port", str(args.port), "--model-name", MODEL, *serve_args]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    watch = MemoryWatch(server.pid)
    rows: dict[str, Any] = {}
    try:
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while True:
            assert server.poll() is None, server.stderr.read() if server.stderr else "the server exited"
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.5)
        watch.start()
        post(base, {"max_tokens": 4})  # warm: the first pass, the grammar process
        post(base, {"max_tokens": 4, "structured_outputs": {"choice": ["yes", "no"]}})
        time.sleep(1.0)
        idle_server, idle_children = watch.now()
        started_all = time.monotonic()
        health_failures = []

        wanted = {int(row) for row in args.rows.split(",")}

        def case(name: str, run: Any) -> None:
            if int(name.split()[0]) not in wanted:
                return
            started = time.monotonic()
            try:
                rows[name] = run()
            except Exception as err:  # noqa: BLE001 - recorded, the run goes on
                rows[name] = {"exception": f"{type(err).__name__}: {err}"}
            health = httpx.get(base + "/health", timeout=10)
            if health.status_code != 200:
                health_failures.append((name, health.status_code))
            peak_server, peak_all = watch.peak_since(started)
            rows[name] = {"result": rows[name], "seconds": round(time.monotonic() - started, 2),
                          "peak_server_growth_mib": round((peak_server - idle_server) / 2**20, 1),
                          "peak_total_growth_mib": round((peak_all - idle_server - idle_children) / 2**20, 1)}
            print(f"{name}: {json.dumps(rows[name])}", flush=True)

        case("1 no finite string", lambda: summary(post(base, {"structured_outputs": {"grammar": 'root ::= "a" root'}})))
        case("2 self-containing required tool", lambda: summary(post(base, {
            "tools": [{"type": "function", "function": {"name": "nest", "parameters": SELF_REQUIRED}}],
            "tool_choice": "required"})))
        case("3 empty language", lambda: [summary(post(base, {"structured_outputs": spec})) for spec in
                                          ({"regex": "[^\\s\\S]"}, {"grammar": "root ::= x\nx ::= y\ny ::= x"})])
        case("4 lone surrogates", lambda: [summary(post(base, body)) for body in (
            {"tools": [{"type": "function", "function": {"name": "f", "description": "\ud800"}}]},
            {"messages": [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": "\ud800"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]})])
        case("5 nested repetition counts", lambda: summary(post(base, {
            "structured_outputs": {"regex": "((a{0,99}){0,99}){0,99}"}})))

        def compiles_and_plain() -> dict[str, Any]:
            idle = plain_latency(base)
            with ThreadPoolExecutor(8) as pool:
                heavy = [pool.submit(post, base, {"structured_outputs": {"regex": f".{{0,1000}}z{i}"}}, True, 600)
                         for i in range(8)]
                time.sleep(1.0)  # the compiles are under way
                busy = plain_latency(base)
                statuses = [f.result().status_code for f in heavy]
            return {"idle_seconds": [round(t, 3) for t in idle], "during_seconds": [round(t, 3) for t in busy],
                    "ratio_of_medians": round(statistics.median(busy) / statistics.median(idle), 2),
                    "heavy_statuses": statuses}

        case("6 plain completion during 8 compiles", compiles_and_plain)

        def schemas() -> dict[str, Any]:
            before = watch.now()
            statuses = []
            for i in range(args.schemas):
                schema = {"type": "object", "properties": {f"field_{i}": {"type": "integer"},
                                                           f"name_{i}": {"type": "string", "maxLength": 8}},
                          "required": [f"field_{i}"]}
                statuses.append(post(base, {"max_tokens": 1, "response_format": {
                    "type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}}).status_code)
            after = watch.now()
            return {"statuses": sorted(set(statuses)), "server_growth_mib": round((after[0] - before[0]) / 2**20, 1)}

        case(f"7 {args.schemas} distinct schemas", schemas)
        case("8 body at 1 byte/s", lambda: slow_body(base, 60.0))

        def salts() -> dict[str, Any]:
            headers = {"Authorization": "Bearer same-key"}
            body = {"max_tokens": 48, "method": "suffix", "messages": [{"role": "user", "content": "List 5 fruits."}]}
            owner = [summary(post(base, {**body, "cache_salt": "owner"}, headers=headers)) for _ in range(3)]
            other = [summary(post(base, {**body, "cache_salt": "other"}, headers=headers)) for _ in range(1)]
            return {"owner_tau": [r.get("tau") for r in owner], "other_salt_tau": [r.get("tau") for r in other],
                    "statuses": sorted({r["status"] for r in owner + other})}

        case("9 same key, other cache_salt", salts)
        case("10 64 requests at once", lambda: crowd(base, 64))
        peak_server, peak_all = watch.peak_since(started_all)
        result = {
            "command": " ".join(command), "rows": rows, "health_failures": health_failures,
            "idle_server_mib": round(idle_server / 2**20, 1), "idle_children_mib": round(idle_children / 2**20, 1),
            "peak_server_growth_mib": round((peak_server - idle_server) / 2**20, 1),
            "peak_total_growth_mib": round((peak_all - idle_server - idle_children) / 2**20, 1),
            "server_alive": server.poll() is None,
        }
        print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    finally:
        watch.stop.set()
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
