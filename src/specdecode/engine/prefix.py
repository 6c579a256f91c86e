"""Prefix caching on the single-request path: a request starts after the longest prefix its prompt
shares with the previous request's committed tokens, whose K/V the target's sequence still holds.

This is what llama-cpp-python's ``Llama`` and a llama-server slot do with one sequence: a chat's
turn n + 1 repeats turn n's prompt and answer, so its prefill shrinks to the new message. The
engine owns the record (``SpecEngine``); the backend only keeps the first ``keep`` positions
when told to (``SequenceModel.begin(capacity, keep)``). The draft model's cache follows: the
drafter is told how many prompt tokens equal the previous request's committed tokens and keeps
as many of its own cached ones (``Drafter.start``'s ``shared_prefix``).

A record is used only by a request of the same cache group (``cache_salt``): reused KV makes
the first token come sooner, so sharing it across groups would tell one group what another
sent. And only while the sequence's ``epoch`` is the one the engine's own request left: timing
passes, a compile warm-up or anyone else's ``begin`` overwrite the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdecode.core.prefix import common_prefix_length


@dataclass(slots=True, frozen=True)
class CachedPrefix:
    """What one sequence's cache holds after a request."""

    tokens: tuple[int, ...]  # the request's committed tokens, prompt and output
    valid: int  # how many of them have their K/V in the cache (the engine's invariant: all but the last)
    salt: str | None  # the request's cache group
    epoch: int  # the sequence's epoch after the request


@dataclass(slots=True, frozen=True)
class PrefixMatch:
    shared: int  # leading prompt tokens equal to the previous request's committed tokens
    keep: int  # positions of the target's cache kept: at most shared, always leaving the last prompt token to compute


NO_MATCH = PrefixMatch(0, 0)


def match_prefix(cached: CachedPrefix | None, prompt_ids: Sequence[int], salt: str | None, epoch: int) -> PrefixMatch:
    """How much of ``prompt_ids`` a request in group ``salt`` may reuse from ``cached``, on a
    sequence now at ``epoch``. The last prompt token is always computed: its logits give the
    first new token (or verify the first draft)."""
    if cached is None or cached.salt != salt or cached.epoch != epoch:
        return NO_MATCH
    shared = common_prefix_length(cached.tokens, prompt_ids)
    return PrefixMatch(shared, min(shared, cached.valid, len(prompt_ids) - 1))
