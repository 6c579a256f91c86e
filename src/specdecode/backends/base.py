"""The model backend interface: what the single-sequence engine and the drafters ask of a model.

A backend runs forward passes of one model over one sequence at a time and keeps that
sequence's KV cache. The engine and the drafters never see the cache itself; they say which
tokens to feed at which positions and how much of the sequence is still valid:

- ``begin(capacity, keep)`` starts a new sequence of at most ``capacity`` positions whose first
  ``keep`` positions are the previous sequence's, still valid in the cache (a cached prefix the
  caller knows the new sequence shares; 0: an empty cache). ``epoch`` counts the sequences begun
  and the scratch passes run (``pass_seconds``, a compile warm-up): a caller that recorded a
  prefix may keep it only while the epoch is the one its own ``begin`` left, since anyone else's
  use of the model overwrites it;
- ``extend(tokens, start)`` feeds tokens at positions ``start .. start + T - 1`` and returns
  the logits of the rows asked for. The cache must hold exactly positions ``[0, start)`` of
  the sequence that is valid: ``extend`` writes past the valid length freely (rejected draft
  tokens, a verify pass), and the next ``commit`` says how much of that stays;
- ``commit(length)`` declares positions ``[0, length)`` valid and drops the rest (rollback of
  rejected tokens is a commit to a shorter length);
- ``pass_seconds(rows)`` times one pass over each row count on this machine, for the
  cost-aware draft length and the auto method.

Two backends implement it: ``torch_backend.TorchSequence`` (our ``Transformer`` and its
static cache: every method, token trees and layer skip included) and
``llamacpp.LlamaCppSequence`` (GGUF files through ggml's CPU kernels: plain decoding, the
draft model, prompt lookup and auto). Both return float32 logits as torch tensors, so
verification (``engine/verify.py``) is the same code for both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from specdecode.config import BACKEND_CHOICES

if TYPE_CHECKING:
    from specdecode.core.tree import TokenTree
    from specdecode.kv.paged import PrefixCacheStats

BACKENDS = BACKEND_CHOICES


class PassOutput(Protocol):
    logits: torch.Tensor | None  # (1, T_logits, V) float32, or None when not asked for
    hidden: torch.Tensor | None  # (1, T, C) final hidden states where the backend has them


class SequenceModel(Protocol):
    """A model decoding one sequence, with that sequence's KV cache (see the module docstring)."""

    backend: str  # "torch" or "llama.cpp"
    # Token trees (Medusa, EAGLE, suffix trees): a backend that scores a tree in one pass with
    # tree attention says so, and has ``extend_tree`` and ``keep_path``.
    supports_trees: bool
    # Whether the first verify pass may also feed the prompt's tail (every prompt token but the
    # cached ones), computing logits for the verify rows only: the first token then costs one
    # pass instead of a prefill and a pass. A backend that compiles each pass shape says no.
    merges_prefill: bool
    epoch: int  # sequences begun and scratch passes run: a recorded prefix is stale once it moves

    @property
    def device(self) -> torch.device: ...

    @property
    def vocab_size(self) -> int: ...

    def begin(self, capacity: int, keep: int = 0) -> None:
        """A new sequence of at most ``capacity`` positions whose first ``keep`` are the previous
        sequence's (valid in the cache, at most its committed length); the rest starts empty."""

    def extend(
        self,
        tokens: torch.Tensor,  # (1, T) long
        start: int,
        *,
        logits_last: int | None = None,
        compute_logits: bool = True,
    ) -> PassOutput:
        """Feed ``tokens`` at positions start .. start + T - 1. Logits for every row, for the last
        ``logits_last`` rows, or none (``compute_logits=False``, a prefill)."""

    def commit(self, length: int) -> None:
        """Positions [0, length) are the sequence; anything written after them is dropped."""

    def extend_tree(self, tree: TokenTree, start: int) -> PassOutput:
        """(``supports_trees`` only) Score every node of ``tree``, its root at position ``start``,
        in one pass: node j's K/V at slot start + j, logits (1, N, V) and hidden states for all."""

    def keep_path(self, start: int, path: Sequence[int]) -> None:
        """(``supports_trees`` only) Keep the nodes ``path`` (root first) of the tree scored at
        ``start`` as positions start, start + 1, ...; the caller commits the new length."""

    def pass_seconds(
        self, row_counts: Sequence[int], repeats: int, logits_last: int | None = None
    ) -> dict[int, float]:
        """Seconds of one pass over each row count (best of ``repeats``), on a scratch sequence."""


class SequencePool(Protocol):
    """Where a batch model keeps its sequences' KV, as the scheduler accounts for it: a paged
    pool of blocks on torch (``kv.paged.PagedKVCache``), a set of sequence slots on llama.cpp
    (``backends.llamacpp_batch.SlotPool``)."""

    block_size: int  # positions per accounting unit
    prefix_cache: bool  # whether ``add`` serves cached prefixes and ``free`` keeps them (on by default)
    prefix_stats: PrefixCacheStats  # positions looked up and served, and evictions, since start

    @property
    def cached_blocks(self) -> int:
        """Units holding a cached prefix (blocks on torch, free slots with a record on llama.cpp)."""

    @property
    def usable_blocks(self) -> int: ...

    @property
    def free_blocks(self) -> int: ...

    @property
    def used_blocks(self) -> int: ...

    def fits(self, tokens: int) -> bool:
        """Whether one sequence of ``tokens`` positions fits in the empty pool."""

    def capacity_tokens(self) -> int:
        """The most positions one sequence can hold in the empty pool (for error messages)."""

    def blocks_needed(self, seq: int | None, tokens: int) -> int:
        """Units to allocate so that ``seq`` (None: a new sequence) holds ``tokens`` positions."""

    def add(self, seq: int, tokens: Sequence[int] = (), group: str | None = None) -> int:
        """A new sequence whose committed tokens are ``tokens``; returns how many leading positions
        it got from the prefix cache of ``group`` (their K/V valid, never its last token's)."""

    def fork(self, source: int, dest: int, length: int | None = None) -> int:
        """A new sequence ``dest`` starting from the first ``length`` committed positions of
        running ``source`` (all of them by default, at most those), shared or copied; returns
        how many it starts with. Needs no free unit beyond what ``add`` would."""

    def register(self, seq: int, tokens: Sequence[int], group: str | None = None) -> None:
        """Make ``seq``'s valid K/V of ``tokens`` findable by later sequences of ``group`` now."""

    def reserve(self, seq: int, tokens: int) -> None:
        """Room for positions [0, tokens) of ``seq``, all or nothing (raises ``OutOfBlocks``)."""

    def drop_cached_prefixes(self) -> None:
        """Forget every cached prefix: later sequences' ``add`` finds none (running ones keep their K/V)."""

    def free(self, seq: int, tokens: Sequence[int] = (), group: str | None = None, returning: bool = False) -> None:
        """``seq`` left; its valid K/V of ``tokens`` stay cached for ``group`` where the pool can,
        kept for ``seq`` itself first when it was preempted and will be readmitted
        (``returning``). Called for a ``seq`` without K/V here (one that left the queue), it
        gives up what was kept for it."""


class BatchModel(Protocol):
    """A model decoding many sequences in one pass: what the batch engine and the batched draft
    model ask of a backend. Sequences are the scheduler's ids; the pool holds their KV.

    ``forward`` feeds row b's tokens at positions ``starts[b] ..`` of sequence ``seqs[b]`` (its
    room reserved in the pool); as with ``SequenceModel.extend``, the pool must hold exactly
    positions ``[0, starts[b])`` that are valid, and ``commit`` says how much of what a pass
    wrote stays.
    """

    pool: SequencePool
    # Whether a pass over rows of very different lengths costs what their tokens cost (a flat
    # batch, llama.cpp's): then a prompt's last chunk is fed with its first verify rows, saving a
    # pass before the first token. A padded batch (torch's) would pad every row to the prompt.
    merges_prefill: bool
    # Whether a pass can score token trees (``forward``'s ``trees``, ``keep_path``): tree
    # attention, which our torch model over a paged pool has and llama.cpp's batch does not.
    supports_trees: bool

    @property
    def device(self) -> torch.device: ...

    @property
    def vocab_size(self) -> int: ...

    def forward(
        self,
        seqs: Sequence[int],
        inputs: Sequence[torch.Tensor],  # B tensors, (T_b,) long each
        starts: Sequence[int],
        logits: str = "all",
        logit_rows: Sequence[int] | None = None,
    ) -> torch.Tensor | None:
        """float32 logits: (B, T_max, V) for "all" (rows past T_b are padding), (B, V) of each
        row's last token for "last", None for "none" (a prefill). With "all", ``logit_rows[b]``
        (given) keeps row b's last ``logit_rows[b]`` tokens only, at ``[b, :logit_rows[b]]`` of a
        (B, max(logit_rows), V) result: a prompt's tail fed with its first drafts.

        Where ``supports_trees``, a ``trees`` keyword (row b: a token tree's parents, or None)
        makes row b's tokens a tree's nodes, root first, scored with tree attention
        (``kv/paged.PagedKVCache.view``)."""

    def commit(self, seq: int, length: int) -> None:
        """Positions [0, length) of ``seq`` are valid; anything written after them is dropped."""

    def keep_path(self, seq: int, root: int, path: Sequence[int]) -> None:
        """Where ``supports_trees``: keep one root-to-node ``path`` of the tree a pass wrote from
        position ``root`` as the sequence's positions root, root + 1, ... (before ``commit``)."""

    def pass_seconds(self, shapes: Sequence[tuple[int, int]], repeats: int) -> dict[tuple[int, int], float]:
        """Seconds of one pass of B sequences x T new tokens for each (B, T) (best of ``repeats``)."""
