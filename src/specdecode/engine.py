"""The decoding loop: prefill -> (draft -> verify -> commit)* for one request.

The engine owns the target's KV cache and the committed token buffer. Plain decoding is
the same loop with zero drafted tokens per step: the target scores the last committed token
alone and "verification" picks its next token, so both paths share every line that matters
for equality.

Invariant between steps: the committed sequence has length L; the target cache holds valid
K/V for positions [0, L - 1); the last committed token is fed by the next verify pass
together with the draft tokens, at positions L - 1 .. L - 1 + k.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch

from .cache import KVCache, reusable_cache
from .config import SamplingParams
from .drafters.base import Drafter
from .metrics import GenerationStats, Stopwatch
from .models.llama import Transformer
from .sampling import LogitsProcessor, make_generator
from .schedule import KSchedule
from .verify import PAD_TOKEN, greedy_verify, rejection_verify


VERIFY_COST_REPEATS = 2
COST_PROBE_CONTEXT = 64  # cache slots before the timed rows, so attention has something to read


@torch.inference_mode()
def time_passes(
    model: Transformer,
    row_counts: Sequence[int],
    kv_dtype: str = "auto",
    repeats: int = VERIFY_COST_REPEATS,
    logits_last: int | None = None,
    layers: Sequence[int] | None = None,
) -> dict[int, float]:
    """Seconds of one forward pass of ``model`` over each row count (best of ``repeats``).

    Runs on a scratch cache of the kind decoding uses (int8 KV included) after
    ``COST_PROBE_CONTEXT`` cached positions, so attention reads something, as in decoding.
    ``logits_last=1`` times a catch-up pass (logits for the last row only); ``layers`` a pass
    through those layers only (layer skip).
    """
    cfg = model.config
    max_rows = max(row_counts)
    scratch = reusable_cache(None, cfg, COST_PROBE_CONTEXT + max_rows, model.dtype, model.device, kv_dtype)
    tokens = torch.zeros((1, max_rows), dtype=torch.long, device=model.device)
    measured = {}
    for rows in row_counts:
        samples = []
        for _ in range(repeats + 1):  # the first call per shape warms up
            with Stopwatch(model.device, True) as watch:
                model.extend(scratch, tokens[:, :rows], COST_PROBE_CONTEXT, logits_last=logits_last, layers=layers)
            samples.append(watch.elapsed)
        measured[rows] = min(samples[1:])  # the least disturbed run
    return measured


class SpecEngine:
    def __init__(
        self,
        target: Transformer,
        eos_token_ids: Sequence[int],
        *,
        sync_timing: bool = False,
        kv_dtype: str = "auto",
    ) -> None:
        self.target = target
        self.eos_token_ids = frozenset(eos_token_ids)
        self.sync_timing = sync_timing
        self.kv_dtype = kv_dtype  # "int8" stores the target's KV cache quantized (cache.Int8KVCache)
        self._cache: KVCache | None = None
        self._verify_costs: dict[int, list[float]] = {}

    @property
    def device(self) -> torch.device:
        return self.target.device

    def verify_costs(self, max_rows: int, repeats: int = VERIFY_COST_REPEATS) -> list[float]:
        """Seconds of a target pass over 1..max_rows rows on this machine (best of ``repeats``).

        Measured once per engine on a scratch cache at a short context, for the cost-aware
        draft length (``schedule.CostAwareK``); cached per ``max_rows``.
        """
        if max_rows in self._verify_costs:
            return list(self._verify_costs[max_rows])
        # Time a few row counts and interpolate the rest: each timing costs full target passes.
        probed = sorted({1, 2, 3, 4, (max_rows + 1) // 2 + 1, max_rows} & set(range(1, max_rows + 1)))
        measured = time_passes(self.target, probed, self.kv_dtype, repeats)
        costs = []
        for rows in range(1, max_rows + 1):
            below = max(r for r in probed if r <= rows)
            above = min(r for r in probed if r >= rows)
            share = 0.0 if above == below else (rows - below) / (above - below)
            costs.append(measured[below] + share * (measured[above] - measured[below]))
        self._verify_costs[max_rows] = costs
        return list(costs)

    @torch.inference_mode()
    def decode(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        drafter: Drafter | None,
        num_speculative_tokens: int,
        stats: GenerationStats,
        schedule: KSchedule | None = None,
    ) -> Iterator[list[int]]:
        """Yield the newly committed tokens after each step; fill ``stats`` as it goes.

        ``num_speculative_tokens`` = 0 (or no drafter) is plain autoregressive decoding. A
        drafter may propose fewer tokens than asked, even none: that step decodes plainly.
        Closing the iterator early (a stop string) still leaves ``stats`` complete.
        ``schedule`` (``schedule.py``) chooses k per step instead, up to ``num_speculative_tokens``.
        """
        started = time.perf_counter()
        device = self.device
        prompt_len = len(prompt_ids)
        max_new = params.max_new_tokens
        speculate = drafter is not None and num_speculative_tokens > 0
        capacity = prompt_len + max_new + 1
        cache = self._cache = reusable_cache(self._cache, self.target.config, capacity, self.target.dtype, device, self.kv_dtype)
        processor = LogitsProcessor.from_params(params)
        generator = None if processor.greedy else make_generator(params.seed, device)
        committed = torch.empty((1, capacity), dtype=torch.long, device=device)
        committed[0, :prompt_len] = torch.tensor(list(prompt_ids), dtype=torch.long)
        stats.prompt_tokens = prompt_len
        draft_watch = Stopwatch(device, self.sync_timing)
        verify_watch = Stopwatch(device, self.sync_timing)
        try:
            # Prefill all but the last prompt token; the first verify pass feeds that one with
            # the first draft, so even the first new token can be speculated.
            with Stopwatch(device, self.sync_timing) as prefill_watch:
                if prompt_len > 1:
                    self.target.extend(cache, committed[:, : prompt_len - 1], 0, compute_logits=False)
                    stats.target_forward_passes += 1
                cache.commit(0, prompt_len - 1)
                if speculate:
                    drafter.start(prompt_len, capacity, cache)
            stats.prefill_seconds = prefill_watch.elapsed

            length = prompt_len
            while True:
                remaining = max_new - stats.new_tokens
                # Never draft past max_new_tokens: a step emits at most k + 1 tokens.
                wanted = schedule.next_k() if speculate and schedule is not None else num_speculative_tokens
                k = min(wanted, num_speculative_tokens, remaining - 1) if speculate else 0
                draft_seconds, draft_passes = 0.0, 0
                draft_tokens = torch.empty((1, 0), dtype=torch.long, device=device)
                draft_probs = None
                if k > 0:
                    with draft_watch:
                        proposal = drafter.propose(committed[:, :length], k, processor, generator)
                    draft_seconds, draft_passes = draft_watch.elapsed, proposal.forward_passes
                    stats.draft_seconds += draft_seconds
                    draft_tokens, draft_probs = proposal.tokens, proposal.probs
                    stats.draft_forward_passes += draft_passes
                    k = proposal.num_tokens
                with verify_watch:
                    inputs = torch.cat([committed[:, length - 1 : length], draft_tokens], dim=1)
                    logits = self.target.extend(cache, inputs, length - 1).logits  # (1, k + 1, V)
                    if processor.greedy:
                        result = greedy_verify(draft_tokens, logits)
                    else:
                        result = rejection_verify(draft_tokens, draft_probs, processor.probs(logits), generator)
                    emitted_row = result.tokens[0].tolist()  # the one host sync of the step
                stats.verify_seconds += verify_watch.elapsed

                # Read the accepted count off the same row: a second tensor read would be a second sync.
                emitted_count = emitted_row.index(PAD_TOKEN) if PAD_TOKEN in emitted_row else len(emitted_row)
                accepted = emitted_count - 1
                stats.record_step(k, accepted)
                if speculate and k > 0:
                    drafter.on_verified(accepted)
                if speculate and schedule is not None:
                    schedule.observe(k, accepted, draft_seconds, draft_passes, verify_watch.elapsed)
                new_tokens = emitted_row[: accepted + 1][:remaining]
                stop_reason = ""
                if not params.ignore_eos:
                    for i, token in enumerate(new_tokens):
                        if token in self.eos_token_ids:
                            new_tokens = new_tokens[: i + 1]
                            stop_reason = "eos"
                            break
                count = len(new_tokens)
                committed[:, length : length + count] = result.tokens[:, :count]
                # K/V of the previously last token and of the accepted drafts are now valid.
                cache.commit(0, length + min(accepted, count - 1))
                length += count
                stats.new_tokens += count
                if not stop_reason and stats.new_tokens >= max_new:
                    stop_reason = "length"
                stats.stop_reason = stop_reason or "running"
                yield new_tokens
                if stop_reason:
                    break
        finally:
            stats.total_seconds = time.perf_counter() - started
