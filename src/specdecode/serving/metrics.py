"""The server's counters and gauges, rendered for ``GET /metrics`` in Prometheus text format."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from specdecode.core.device import resident_bytes
from specdecode.drafters.suffix_cache import SuffixCache
from specdecode.engine.metrics import GenerationStats
from specdecode.serving.worker import BatchWorker

OUTCOMES = ("ok", "error", "cancelled", "rejected", "timeout", "shutdown", "overloaded", "queue_timeout")
# Finished requests whose time in a seat (from starting to decode to the end) the Retry-After
# estimate averages: enough to smooth one long or short request, few enough to follow the load.
RECENT_SEATS = 32


@dataclass(slots=True)
class ServerMetrics:
    """Counters for /metrics; updated under ``lock`` from worker threads."""

    # ok; error (the server failed); cancelled (the client left); rejected (bad input, 4xx);
    # timeout (past --request-timeout); shutdown (ended by a drain past --drain-timeout);
    # overloaded (refused at once: --max-waiting requests already waiting, or past
    # --max-connections); queue_timeout (ended after waiting --max-queue-time without starting).
    requests: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of them, served from the prefix cache
    prefix_cache_hits: int = 0  # requests that reused a cached prefix
    generated_tokens: int = 0
    verify_steps: int = 0
    emitted_by_steps: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    worker: BatchWorker | None = None
    suffix_cache: SuffixCache | None = None  # earlier responses for suffix decoding
    # Labels on every series, e.g. {"replica": ...} under Ray Serve, where replicas' series meet.
    labels: dict[str, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Seconds recent requests that finished ok held their seat in the batch.
    seat_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_SEATS))

    def observe_seat(self, seconds: float) -> None:
        """A request that finished ok held its seat in the batch for ``seconds``."""
        with self.lock:
            self.seat_seconds.append(seconds)

    def mean_seat_seconds(self) -> float | None:
        """How long recent requests held a seat, on average (None before any finished)."""
        with self.lock:
            recent = self.seat_seconds
            return sum(recent) / len(recent) if recent else None

    def count(self, status: str) -> None:
        """Count a request that ended without decoding (rejected, or failed before its first step)."""
        with self.lock:
            self.requests[status] += 1

    def record(self, stats: GenerationStats, status: str) -> None:
        with self.lock:
            self.requests[status] += 1
            self.prompt_tokens += stats.prompt_tokens
            self.cached_prompt_tokens += stats.cached_tokens
            self.prefix_cache_hits += stats.cached_tokens > 0
            self.generated_tokens += stats.new_tokens
            self.verify_steps += stats.verify_steps
            self.emitted_by_steps += stats.emitted_by_steps
            self.draft_tokens_proposed += stats.draft_tokens_proposed
            self.draft_tokens_accepted += stats.draft_tokens_accepted

    def prometheus(self) -> str:
        with self.lock:
            tau = self.emitted_by_steps / self.verify_steps if self.verify_steps else 0.0
            engine = self.worker.engine if self.worker is not None else None
            batch, queued = (engine.num_running, engine.num_waiting) if engine is not None else (0, 0)
            pool = engine.target_cache if engine is not None else None
            acceptance = self.draft_tokens_accepted / self.draft_tokens_proposed if self.draft_tokens_proposed else 0.0
            lines = ["# HELP specdecode_requests_total Finished requests by outcome.",
                     "# TYPE specdecode_requests_total counter"]
            fixed = "".join(f'{name}="{value}",' for name, value in sorted(self.labels.items()))
            lines += [f'specdecode_requests_total{{{fixed}status="{k}"}} {v}' for k, v in sorted(self.requests.items())]
            rows = [
                ("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", self.prompt_tokens),
                ("prompt_tokens_cached_total", "counter", "Prompt tokens served from the prefix cache (not prefilled).",
                 self.cached_prompt_tokens),
                ("prefix_cache_hits_total", "counter", "Requests that reused a cached prompt prefix.",
                 self.prefix_cache_hits),
                ("generated_tokens_total", "counter", "Tokens generated.", self.generated_tokens),
                ("verify_steps_total", "counter", "Target verify passes.", self.verify_steps),
                ("draft_tokens_proposed_total", "counter", "Draft tokens proposed.", self.draft_tokens_proposed),
                ("draft_tokens_accepted_total", "counter", "Draft tokens accepted.", self.draft_tokens_accepted),
                ("tau", "gauge", "Mean tokens per verify pass, bonus token counted, since start.", tau),
                ("acceptance_rate", "gauge", "Accepted over proposed draft tokens, since start.", acceptance),
                ("requests_running", "gauge", "Requests decoding now.", batch),
                ("requests_waiting", "gauge", "Requests queued for the batch.", queued),
                ("batch_size", "gauge", "Sequences in the batch engine's current step.", batch),
                ("kv_blocks_used", "gauge", "Target KV blocks held by batched requests.", pool.used_blocks if pool else 0),
                ("kv_blocks_total", "gauge", "Target KV blocks in the batch engine's pool.", pool.usable_blocks if pool else 0),
                ("preemptions_total", "counter", "Batched requests preempted for KV blocks (recomputed later).",
                 engine.scheduler.preemptions if engine is not None else 0),
                ("fair_preemptions_total", "counter",
                 "Batched requests that gave their seat to a waiting request (time slice; K/V kept cached).",
                 engine.scheduler.fair_preemptions if engine is not None else 0),
            ]
            if pool is not None:
                prefix = pool.prefix_stats
                rows += [
                    ("prefix_cache_hit_rate", "gauge", "Batched prompt positions served from the prefix cache, of those "
                     "looked up, since start.", prefix.hit_tokens / prefix.queried_tokens if prefix.queried_tokens else 0.0),
                    ("prefix_cache_blocks", "gauge", "Target KV blocks (llama.cpp: slots) holding a cached prefix.",
                     pool.cached_blocks),
                    ("prefix_cache_evictions_total", "counter", "Cached prefix blocks (or slots) reused for new content.",
                     prefix.evictions),
                ]
            if self.suffix_cache is not None:
                suffix = self.suffix_cache.stats()
                rows += [
                    ("suffix_cache_tokens", "gauge", "Response tokens kept for suffix decoding (all tenants).", suffix.tokens),
                    ("suffix_cache_max_tokens", "gauge", "The suffix cache's token budget (--suffix-cache-tokens).",
                     suffix.max_tokens),
                    ("suffix_cache_responses", "gauge", "Responses kept for suffix decoding.", suffix.responses),
                    ("suffix_cache_groups", "gauge", "Tenancy groups (API key and cache_salt; or one global group) with responses kept.", suffix.groups),
                    ("suffix_cache_nodes", "gauge", "Suffix-tree nodes over the kept responses.", suffix.nodes),
                ]
            rss = resident_bytes()
            if rss is not None:
                rows.append(("process_resident_memory_bytes", "gauge", "The server process's resident memory.", rss))
            for name, kind, help_text, value in rows:
                series = f"specdecode_{name}{{{fixed[:-1]}}}" if fixed else f"specdecode_{name}"
                lines += [f"# HELP specdecode_{name} {help_text}", f"# TYPE specdecode_{name} {kind}", f"{series} {value}"]
        return "\n".join(lines) + "\n"
