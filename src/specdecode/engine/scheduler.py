"""Continuous batching: which requests decode in the next step, and room for them in the KV pools.

Requests wait in a queue and join the running batch between steps while the batch has room
(``max_batch``) and the KV pools have free blocks for the request's committed tokens plus one
step of drafting. The next to join is the waiting request that has taken part in the fewest
decode steps (``served``), in arrival order among equals: new requests in arrival order, ahead
of requests that were preempted after running. A request that does not fit in the pools holds
back the ones behind it, so a long prompt is not starved by short ones.

Fairness (``SchedulerConfig``; docs/design.md#fair-scheduling): a full batch does not make a
new request wait for other requests to finish. When the batch has no free seat, the next
waiting request fits in the pools, and a running request has taken part in at least
``time_slice`` more steps than it and has run ``time_slice`` steps since its admission, the
running request that has been served most is preempted (``preempt(..., fair=True)``): it goes
to the back of the queue and its K/V stay cached (a torch pool's LRU blocks, a llama.cpp spare
slot), so it resumes with next to no recomputation when a seat is free or it is its turn again.
Requests that outgrow the batch share it round robin, ``time_slice`` steps at a time. Fairness
trades seats only: a request that lacks KV blocks waits as before. Prompts are prefilled in
chunks (the engine's job: ``prefilled`` records how far), so a long prompt does not stall the
steps of the running batch either.

With prefix caching, a pool gives a sequence the K/V of the longest cached prefix of its tokens
when it is admitted (``SequencePool.add``; recorded in ``cached_target`` / ``cached_draft``), and
keeps a leaving sequence's K/V for later ones (``free``), in the sequence's cache group. A
preempted sequence readmitted later finds its own blocks again while nobody evicted them.

A request whose prompt shares a long prefix with one that is being prefilled now (the same
system prompt, sent at the same moment) waits until that prefix is computed, then takes its K/V
from the other (``wait_for_prefix``): computing it twice, in one padded pass, would cost a
compute-bound CPU twice the time and give neither request its first token sooner. It waits
only when that saves at least half of what it would prefill if admitted now (a chunked prefill
makes each chunk findable) and ``MIN_PREFIX_TO_WAIT_FOR`` tokens, and holds back the requests
behind it as a request that does not fit does.

Parallel samples of one prompt (n > 1): the first is admitted as any request; the others wait
behind it until it has been prefilled, then start from its prompt K/V (``SequencePool.fork``:
shared blocks on torch, a copied slot on llama.cpp), so the prompt is computed once. If the
first has left by then, they take the prefix cache's path like any request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specdecode.backends.base import SequencePool
from specdecode.core.prefix import common_prefix_length
from specdecode.errors import InvalidRequestError
from specdecode.kv.paged import OutOfBlocks

# A shorter shared prefix is recomputed rather than waited for: on a GPU, where a prefill of a
# few more tokens costs next to nothing, waiting would only add a pass to the first token.
MIN_PREFIX_TO_WAIT_FOR = 64


@dataclass(slots=True, eq=False)
class ScheduledSequence:
    """What the scheduler needs to know about one request; the engine keeps the rest in ``state``."""

    seq_id: int
    num_tokens: int  # committed tokens (prompt + output so far)
    max_tokens: int  # the most committed tokens it can reach (prompt + max_new_tokens)
    uses_draft: bool  # keeps a sequence in the draft model's pool
    state: Any = None
    tokens: list[int] = field(default_factory=list)  # its committed tokens (the engine's list, shared)
    cache_group: str | None = None  # whose cached prefixes it may reuse, and who may reuse its
    cached_target: int = 0  # positions the target pool served from its prefix cache at the last admission
    cached_draft: int = 0  # the same for the draft pool
    # Another sample of the same prompt (parallel sampling, n > 1): this sequence starts from its
    # prompt K/V (``SequencePool.fork``) instead of prefilling, once that one has been prefilled.
    fork_of: ScheduledSequence | None = None
    prefilled: int = 0  # target positions with valid K/V since the last admission (chunked prefill)
    served: int = 0  # decode steps it has taken part in, over all its admissions
    served_at_admission: int = 0  # ``served`` when it was last admitted

    @property
    def prefilling(self) -> bool:
        """Whether its committed tokens but the last still lack target K/V (it does not decode yet)."""
        return self.prefilled < self.num_tokens - 1


class Scheduler:
    def __init__(
        self,
        target_cache: SequencePool,
        draft_cache: SequencePool | None,
        max_batch: int,
        step_lookahead: int,
        time_slice: int = 0,
        wait_for_prefix: bool = True,
    ) -> None:
        if max_batch < 1:
            raise InvalidRequestError(f"max_batch must be >= 1, got {max_batch}.")
        self.target_cache = target_cache
        self.draft_cache = draft_cache
        self.max_batch = max_batch
        # Slots past the committed tokens one step may write: the verify pass's k + 1 rows.
        self.step_lookahead = step_lookahead
        self.time_slice = time_slice  # 0: no preemption for fairness (the module docstring)
        self.wait_for_prefix = wait_for_prefix  # for a prefix another request is prefilling (the module docstring)
        self.waiting: deque[ScheduledSequence] = deque()
        self.running: list[ScheduledSequence] = []
        self.preemptions = 0  # for KV blocks: recomputed from the tokens unless their blocks are still cached
        self.fair_preemptions = 0  # for a waiting request's turn: K/V kept cached

    def _pools(self, seq: ScheduledSequence) -> list[SequencePool]:
        pools = [self.target_cache]
        if seq.uses_draft:
            if self.draft_cache is None:
                raise InvalidRequestError("This engine has no draft model.")
            pools.append(self.draft_cache)
        return pools

    def add(self, seq: ScheduledSequence) -> None:
        """Queue a request; refuse one that could not fit in an empty pool."""
        self.check_fits(seq.max_tokens, seq.uses_draft)
        self.waiting.append(seq)

    def check_fits(self, max_tokens: int, uses_draft: bool) -> None:
        """Raise InvalidRequestError unless a sequence of ``max_tokens`` fits in an empty pool."""
        need = max_tokens + self.step_lookahead
        pools = [self.target_cache] + ([self.draft_cache] if uses_draft and self.draft_cache is not None else [])
        for pool in pools:
            if not pool.fits(need):
                raise InvalidRequestError(
                    f"The request needs up to {need} KV slots but a sequence can hold at most "
                    f"{pool.capacity_tokens()}; lower max_new_tokens= or give the engine a larger KV cache "
                    "(kv_cache_tokens=)."
                )

    def admit(self, preempted: list[ScheduledSequence] | None = None) -> list[ScheduledSequence]:
        """Move waiting requests into the batch while they fit, preempting for fairness where
        the batch is full (the module docstring); returns the ones admitted now, and appends
        the ones preempted for them to ``preempted``."""
        admitted: list[ScheduledSequence] = []
        while self.waiting:
            seq = self._next_waiting()
            source = seq.fork_of
            if source is not None and source in self.waiting and source.served > 0:
                # Its source was preempted after it ran (for fairness): waiting for it to return
                # could wait forever, as this request is served less and so comes first.
                # Start from the prefix cache instead, which holds the source's prompt.
                seq.fork_of = source = None
            if source is not None and (source in admitted or source in self.waiting or source.prefilling):
                break  # its prompt K/V is not computed yet: wait for a coming step
            if source is None and self._prefix_in_progress(seq, admitted):
                break  # another is computing most of its prompt: take it from there at a coming step
            need = seq.num_tokens + self.step_lookahead
            if any(pool.blocks_needed(None, need) > pool.free_blocks for pool in self._pools(seq)):
                break
            if len(self.running) >= self.max_batch:
                victim = self._fair_victim(seq)
                if victim is None:
                    break
                self.preempt(victim, fair=True)
                if preempted is not None:
                    preempted.append(victim)
                continue  # the pools' free blocks changed: check again
            self.waiting.remove(seq)
            # Forked only from a running source, and only the first time: after a preemption a
            # sequence is recomputed from its own tokens.
            fork = source is not None and source in self.running
            seq.fork_of = None
            kept = []
            for pool in self._pools(seq):  # reserved now, so the next request sees what is left
                if fork and (pool is self.target_cache or source.uses_draft):
                    assert source is not None
                    kept.append(pool.fork(source.seq_id, seq.seq_id, seq.num_tokens - 1))
                else:
                    kept.append(pool.add(seq.seq_id, seq.tokens, seq.cache_group))
                pool.reserve(seq.seq_id, need)
            seq.cached_target = seq.prefilled = kept[0]
            seq.cached_draft = kept[1] if len(kept) > 1 else 0
            seq.served_at_admission = seq.served
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def _prefix_in_progress(self, seq: ScheduledSequence, admitted: list[ScheduledSequence]) -> bool:
        """Whether a request of ``seq``'s cache group that is being prefilled (or admitted in this
        call) will compute a prefix of ``seq``'s prompt that no pool holds yet, of at least half
        of what ``seq`` would prefill if admitted now and ``MIN_PREFIX_TO_WAIT_FOR`` tokens. Not for a request
        readmitted after a preemption: its own K/V are what it looks for."""
        if not self.wait_for_prefix or not self.target_cache.prefix_cache or seq.served > 0:
            return False
        own = len(seq.tokens) - 1  # positions it would prefill with nothing cached
        if own < MIN_PREFIX_TO_WAIT_FOR:
            return False
        for other in self.running:
            if other.cache_group != seq.cache_group or not (other.prefilling or other in admitted):
                continue
            shared = min(common_prefix_length(other.tokens[:own], seq.tokens), len(other.tokens) - 1)
            # Admitted now, it would start from what the other has computed (a chunked prefill
            # registers each chunk) and prefill the rest itself, ``pending`` of it the other's.
            pending = shared - other.prefilled
            if pending >= max(MIN_PREFIX_TO_WAIT_FOR, (own - min(shared, other.prefilled) + 1) // 2):
                return True
        return False

    def _next_waiting(self) -> ScheduledSequence:
        """The waiting request to admit next: the least served, first in the queue among equals
        (the queue's head when fairness is off)."""
        if not self.time_slice:
            return self.waiting[0]
        return min(self.waiting, key=lambda seq: seq.served)  # min keeps the first of equals

    def _fair_victim(self, waiting: ScheduledSequence) -> ScheduledSequence | None:
        """The running request whose seat ``waiting`` takes now, or None: the most served among
        those that ran ``time_slice`` steps since their admission and were served ``time_slice``
        steps more than ``waiting``. (Requests admitted in this call, or still prefilling, have
        decoded no step since their admission, so they are never chosen.)"""
        if not self.time_slice:
            return None
        slice_ = self.time_slice
        candidates = [seq for seq in self.running
                      if seq.served - seq.served_at_admission >= slice_ and seq.served >= waiting.served + slice_]
        return max(candidates, key=lambda seq: (seq.served, seq.num_tokens), default=None)

    def record_step(self, seqs: list[ScheduledSequence]) -> None:
        """``seqs`` took part in a decode step (their share of the batch, for fairness)."""
        for seq in seqs:
            seq.served += 1

    def reserve(
        self,
        needs: Callable[[ScheduledSequence], tuple[int, int]],
    ) -> list[ScheduledSequence]:
        """Reserve each running sequence's slots for the step: ``needs(seq)`` gives (target, draft)
        slot counts. Preempts the youngest sequences when blocks run out; returns the preempted."""
        preempted: list[ScheduledSequence] = []
        index = 0
        while index < len(self.running):
            seq = self.running[index]
            target_slots, draft_slots = needs(seq)
            try:
                self.target_cache.reserve(seq.seq_id, target_slots)
                if seq.uses_draft and draft_slots > 0:
                    assert self.draft_cache is not None
                    self.draft_cache.reserve(seq.seq_id, draft_slots)
            except OutOfBlocks:
                victim = self.running[-1]
                self.preempt(victim)
                preempted.append(victim)
                continue  # retry this sequence (or stop, if it was the victim)
            index += 1
        return preempted

    def preempt(self, seq: ScheduledSequence, fair: bool = False) -> None:
        """Free the sequence's blocks (its K/V stay cached where the pool can keep them) and
        queue it: first when the pool ran out of blocks, last when it gave its seat to a waiting
        request (``fair``). Readmitted, it computes only what is no longer cached."""
        self._release(seq, returning=True)
        if fair:
            self.fair_preemptions += 1
            self.waiting.append(seq)
        else:
            self.preemptions += 1
            self.waiting.appendleft(seq)

    def finish(self, seq: ScheduledSequence) -> None:
        """The request ended (done, cancelled or failed): return its blocks, forget it."""
        if seq in self.running:
            self._release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            for pool in self._pools(seq):  # what a pool kept for it since a preemption is anyone's now
                pool.free(seq.seq_id)

    def _release(self, seq: ScheduledSequence, returning: bool = False) -> None:
        self.running.remove(seq)
        for pool in self._pools(seq):
            pool.free(seq.seq_id, seq.tokens, seq.cache_group, returning=returning)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
