"""CPU time each thread of a running server spends per streamed token: one greedy 256-token chat
request, per-thread utime + stime from /proc/<pid>/task/*/stat before and after (sampled every
20 ms, so threads that live for one request are caught). Linux only; 10 ms tick resolution.

    specdecode serve --backend llama.cpp --method none --port 8143 &
    python benchmarks/server_thread_cpu.py $(pgrep -f "port 8143" | head -1) 8143
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import httpx


def snapshot(pid: int) -> dict[str, float]:
    """Thread id -> CPU seconds used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = open(f"/proc/{pid}/task/{tid}/stat").read()
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended
        fields = stat[stat.rindex(")") + 2 :].split()
        out[tid] = (int(fields[11]) + int(fields[12])) / tick
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pid", type=int)
    parser.add_argument("port", type=int)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    model = httpx.get(f"http://127.0.0.1:{args.port}/v1/models").json()["data"][0]["id"]
    before, latest, done = snapshot(args.pid), {}, threading.Event()

    def sample() -> None:
        while not done.is_set():
            latest.update(snapshot(args.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    body = {"model": model, "messages": [{"role": "user", "content": "Write a long story about a robot."}],
            "max_tokens": args.tokens, "stream": True, "temperature": 0, "ignore_eos": True}
    events, started = 0, time.perf_counter()
    with httpx.stream("POST", f"http://127.0.0.1:{args.port}/v1/chat/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            events += line.startswith("data:") and '"content"' in line
    wall = time.perf_counter() - started
    done.set()
    sampler.join()
    print(f"{wall:.2f} s, {events} content events")
    for tid, cpu in sorted(latest.items(), key=lambda item: before.get(item[0], 0.0) - item[1]):
        used = cpu - before.get(tid, 0.0)
        if used > 0.005:
            print(f"  thread {tid:>8}: {used:.2f} s CPU, {used / max(events, 1) * 1e3:.2f} ms per event")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
