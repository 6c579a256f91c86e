"""Earlier responses for suffix decoding: one suffix tree per group, a token budget, LRU eviction.

A *group* is who may draft from whose responses: the library uses one group per ``SpecDecoder``
(``DEFAULT_GROUP``), the server one per tenancy key (``serving/suffix_share.py``: with
``--suffix-share tenant``, requests with the same API key and ``cache_salt``), one per salt for
everyone (``global``) or none at all (``none``). Responses of different groups never meet: each
group has its own tree. Requests never read another group's tree,
because a tree shared across users leaks through timing (a request that speculates well tells
its sender that someone sent similar text).

Memory is bounded by ``max_tokens`` over all groups together: a response is written token by
token as it commits (``append``), and when the total passes the budget the least recently used
responses are removed, whole, from their trees ("used": written to, or read by a draft). A group
whose last response goes is dropped. The bytes the trees hold are counted on demand
(``stats``); per stored token they depend on the text (how much of it repeats) and the depth
bound, and the bench reports them.

The cache also keeps each group's calibration memory (``CalibrationMemory``): how well its
requests' drafts were accepted per match length, which a new request of the group starts from.
``clear`` forgets responses, not that.

Thread-safe: the server's batch thread and its single-sequence requests share one cache.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from specdecode.config import DEFAULT_SUFFIX_CACHE_TOKENS
from specdecode.drafters.suffix_tree import Draft, SuffixTree
from specdecode.errors import InvalidRequestError

DEFAULT_GROUP = ""  # the one group of a library decoder (and the server's --suffix-share global)
DEFAULT_MAX_DEPTH = 64  # tokens of match plus draft a tree path may hold: a 32-token match, 32 drafted
MAX_OPEN_RESPONSES = 256  # responses still taking tokens; past it the least recently written are closed
MATCH_BUCKETS = 5  # match lengths 1, 2-3, 4-7, 8-15, 16+: a longer match predicts better
CALIBRATION_DECAY = 0.9  # weight an older step keeps in a calibration: a window of ~10 steps
MEMORY_CARRY = 0.5  # a new request starts from its group's calibration memory at this weight


def match_bucket(match_len: int) -> int:
    """Match lengths 1, 2-3, 4-7, 8-15, 16+ -> 1..5 (0: no match)."""
    return min(match_len.bit_length(), MATCH_BUCKETS)


@dataclass(slots=True)
class BucketCalibration:
    """Per match-length bucket, the drafted edges accepted and the edges the counts predicted,
    each step's weight fading by ``CALIBRATION_DECAY`` per later step of the same bucket."""

    accepted: list[float] = field(default_factory=lambda: [0.0] * (MATCH_BUCKETS + 1))
    predicted: list[float] = field(default_factory=lambda: [0.0] * (MATCH_BUCKETS + 1))

    def record(self, bucket: int, accepted: float, predicted: float) -> None:
        self.accepted[bucket] = self.accepted[bucket] * CALIBRATION_DECAY + accepted
        self.predicted[bucket] = self.predicted[bucket] * CALIBRATION_DECAY + predicted

    def scaled(self, weight: float) -> BucketCalibration:
        return BucketCalibration([a * weight for a in self.accepted], [p * weight for p in self.predicted])


class CalibrationMemory:
    """Per group, the calibration of the group's recent steps (``BucketCalibration``).

    A request used to start every bucket from the hopeful prior (counts are right), so each one
    paid for a failed draft per bucket before its own measurements stopped it: on llama.cpp, where
    a 2-row verify costs 1.65 passes, that was most of suffix decoding's loss on short answers.
    Starting from the group's memory at ``MEMORY_CARRY`` weight (about 5 steps' evidence), a
    bucket that keeps failing is not retried by every request, and one that pays is drafted
    from the first step; the request's own steps outweigh it within a few steps.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: dict[str, BucketCalibration] = {}

    def seed(self, group: str) -> BucketCalibration:
        """A new request's starting calibration: its group's memory, faded."""
        with self._lock:
            return self._groups.get(group, BucketCalibration()).scaled(MEMORY_CARRY)

    def record(self, group: str, bucket: int, accepted: float, predicted: float) -> None:
        with self._lock:
            self._groups.setdefault(group, BucketCalibration()).record(bucket, accepted, predicted)


@dataclass(frozen=True, slots=True)
class ResponseHandle:
    """Where one request writes its response: a sequence in its group's tree."""

    group: str
    seq_id: int


@dataclass(frozen=True, slots=True)
class SuffixCacheStats:
    groups: int
    responses: int
    tokens: int  # stored response tokens, at most max_tokens
    max_tokens: int
    nodes: int  # tree nodes (repeated runs; single-occurrence runs are references, not nodes)
    bytes: int | None  # Python heap bytes of the trees (None when not measured)

    @property
    def bytes_per_token(self) -> float | None:
        return self.bytes / self.tokens if self.bytes is not None and self.tokens else None


class SuffixCache:
    def __init__(self, max_tokens: int = DEFAULT_SUFFIX_CACHE_TOKENS, max_depth: int = DEFAULT_MAX_DEPTH) -> None:
        if max_tokens < 0:
            raise InvalidRequestError(f"suffix_cache_tokens must be >= 0 (0 keeps no earlier responses), got {max_tokens}.")
        if max_depth < 2:
            raise InvalidRequestError(f"The suffix trees' depth bound must be >= 2, got {max_depth}.")
        self.max_tokens = max_tokens
        self.max_depth = max_depth
        self._lock = threading.Lock()
        self._trees: dict[str, SuffixTree] = {}
        self._lru: OrderedDict[ResponseHandle, None] = OrderedDict()  # least recently used first
        self._open: OrderedDict[ResponseHandle, None] = OrderedDict()  # least recently written first
        self._tokens = 0
        self.calibration = CalibrationMemory()  # per group, kept by clear()

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    def open(self, group: str) -> ResponseHandle | None:
        """A new response in ``group``'s tree (None when the cache keeps nothing)."""
        if not self.enabled:
            return None
        with self._lock:
            tree = self._trees.get(group)
            if tree is None:
                tree = self._trees[group] = SuffixTree(self.max_depth)
            handle = ResponseHandle(group, tree.add_sequence())
            self._lru[handle] = None
            self._open[handle] = None
            while len(self._open) > MAX_OPEN_RESPONSES:  # a finished response holds its open suffixes until closed
                stale, _ = self._open.popitem(last=False)
                self._trees[stale.group].close(stale.seq_id)
            return handle

    def append(self, handle: ResponseHandle | None, tokens: Sequence[int]) -> None:
        """Add committed tokens to a response; evict while over budget. A response that was
        evicted or closed takes no more tokens."""
        if handle is None or not tokens:
            return
        with self._lock:
            if handle not in self._open:
                return
            self._trees[handle.group].extend(handle.seq_id, tokens)
            self._tokens += len(tokens)
            self._lru.move_to_end(handle)
            self._open.move_to_end(handle)
            self._evict()

    def close(self, handle: ResponseHandle | None) -> None:
        """The response is complete: it stays for drafting but takes no more tokens."""
        if handle is None:
            return
        with self._lock:
            if handle in self._open:
                del self._open[handle]
                self._trees[handle.group].close(handle.seq_id)

    def draft(
        self, group: str, context: Sequence[int], *, max_nodes: int, max_depth: int, min_prob: float, max_match: int,
        branching: int | None = None, spec_factor: float | None = None,
    ) -> Draft:
        """``SuffixTree.draft`` on ``group``'s tree (an empty draft for an unknown group); the
        responses the draft read count as used."""
        with self._lock:
            tree = self._trees.get(group)
            if tree is None:
                return Draft()
            draft = tree.draft(context, max_nodes=max_nodes, max_depth=max_depth, min_prob=min_prob, max_match=max_match,
                               branching=branching, spec_factor=spec_factor)
            for seq_id in draft.sequences:
                handle = ResponseHandle(group, seq_id)
                if handle in self._lru:
                    self._lru.move_to_end(handle)
            return draft

    def _evict(self) -> None:
        while self._tokens > self.max_tokens and self._lru:
            handle, _ = self._lru.popitem(last=False)
            self._open.pop(handle, None)
            tree = self._trees[handle.group]
            self._tokens -= tree.length(handle.seq_id)
            tree.remove(handle.seq_id)
            if tree.num_sequences == 0:
                del self._trees[handle.group]

    def clear(self) -> None:
        """Forget every response (the bench does this before each conversation)."""
        with self._lock:
            self._trees.clear()
            self._lru.clear()
            self._open.clear()
            self._tokens = 0

    def stats(self, measure_bytes: bool = False) -> SuffixCacheStats:
        """Counts of what is stored; with ``measure_bytes`` also the trees' heap bytes (walks
        every tree: for reports, not for every request)."""
        with self._lock:
            trees = list(self._trees.values())
            return SuffixCacheStats(
                groups=len(trees), responses=len(self._lru), tokens=self._tokens, max_tokens=self.max_tokens,
                nodes=sum(t.num_nodes for t in trees),
                bytes=sum(t.memory_bytes() for t in trees) if measure_bytes else None,
            )
