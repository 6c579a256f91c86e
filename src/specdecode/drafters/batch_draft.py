"""A draft model proposing for many sequences at once, over its own KV pool (any backend's
``BatchModel``).

The batched twin of ``DraftModelDrafter``: the same bookkeeping per sequence (after a step in
which the target accepted n of k drafted tokens, the draft cache keeps the old committed
sequence plus min(n, k - 1) drafted tokens), but one forward pass serves every sequence of the
batch: a catch-up pass feeds each row the committed tokens it has not seen (one or two,
padded to the longest row), then each further pass feeds every still-drafting row its last
drafted token. Rows may draft different numbers of tokens. A row further behind (a new
sequence, or one the batch decoded plainly for a while) first reads its backlog in a read-ahead
pass of its own, so the draft model costs nothing for requests that never draft.

Sampling is per row with that request's processor and generator, so each request's q is the
distribution its own tokens were drawn from and verification stays lossless row by row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdecode.backends.base import BatchModel, SequencePool
from specdecode.core.sampling import LogitsProcessor, draw
from specdecode.core.timing import Stopwatch
from specdecode.drafters.base import DraftProposal
from specdecode.drafters.draft_model import draft_confidence, to_target_vocab

CATCH_UP_WIDTH = 2  # unseen tokens after a verify step: the bonus token, plus the last draft if all were accepted


@dataclass(slots=True)
class _DraftState:
    cached_len: int = 0  # committed tokens whose K/V sit in the draft cache
    proposed_base: int = 0  # committed length when the last proposal was made
    proposed_count: int = 0


@dataclass(slots=True)
class DraftRow:
    """One sequence's request for drafts this step."""

    seq: int
    committed: torch.Tensor  # (L,) long, on the device: the committed tokens
    num_tokens: int  # >= 1
    processor: LogitsProcessor
    generator: torch.Generator | None
    # Stop this row's drafting once the draft's own probability for the token it just proposed
    # falls below this (0: never), as ``DraftModelDrafter`` does; decided from draft-side
    # information only, so verification stays lossless.
    confidence_threshold: float = 0.0


class BatchDraftModel:
    def __init__(self, model: BatchModel, target_vocab_size: int) -> None:
        self.model = model
        self.target_vocab_size = target_vocab_size
        self._states: dict[int, _DraftState] = {}

    @property
    def cache(self) -> SequencePool:
        return self.model.pool

    def add(self, seq: int, cached: int = 0) -> None:
        """A new (or readmitted) sequence; the scheduler has given it a block table in the draft
        pool, whose first ``cached`` positions came from the prefix cache. Nothing runs yet: the
        draft reads the rest the first time the sequence drafts, so a request that the batch
        decodes plainly (k = 0 under load) never costs a draft pass."""
        self._states[seq] = _DraftState(cached_len=cached)

    def backlog(self, seq: int, committed_len: int) -> int:
        """Committed tokens ``seq``'s next proposal reads ahead first (0 when it is caught up)."""
        unseen = committed_len - self._states[seq].cached_len
        return unseen - 1 if unseen > CATCH_UP_WIDTH else 0

    def _read_ahead(self, rows: Sequence[DraftRow], states: Sequence[_DraftState]) -> int:
        """Feed rows that are far behind (new sequences, or after plain steps) all their unseen
        committed tokens but the last, in one padded pass; returns the passes run (0 or 1).
        Keeps the catch-up pass that follows one or two tokens wide for every row."""
        behind = [(row, state) for row, state in zip(rows, states, strict=True)
                  if row.committed.shape[0] - state.cached_len > CATCH_UP_WIDTH]
        if not behind:
            return 0
        for row, _ in behind:
            self.cache.reserve(row.seq, row.committed.shape[0] - 1)
        self.model.forward([row.seq for row, _ in behind], [row.committed[state.cached_len : -1] for row, state in behind],
                           [state.cached_len for _, state in behind], logits="none")
        for row, state in behind:
            state.cached_len = row.committed.shape[0] - 1
            self.model.commit(row.seq, state.cached_len)
        return 1

    def time_passes(self, seq: int, committed: torch.Tensor, passes: int) -> list[float]:
        """Seconds of ``passes`` one-token passes over ``seq``'s next unseen committed tokens
        (``committed``: (L,) long, on the device), each as dear as a draft pass: how the engine
        re-prices a draft model its cost table priced out (``BatchK.model_try``) without reading a
        long backlog first (a try that drafted read a 365-token prompt first: 1.6 s of a 7.7 s
        turn, measured). The tokens read stay read. Each pass attends to the row's draft context
        so far (short where the draft model never read the row: a little cheap against a long
        one; its live passes, once it drafts, correct that). Synchronises the device around each
        pass (a rare step)."""
        state = self._states[seq]
        seconds = []
        for _ in range(passes):
            # Never past the committed tokens but the last: the slots a plain step reserved. A row
            # already caught up has its last cached token written again (the same K/V).
            position = min(state.cached_len, committed.shape[0] - 2)
            self.cache.reserve(seq, position + 1)
            with Stopwatch(self.model.device, sync=True) as watch:
                self.model.forward([seq], [committed[position : position + 1]], [position], logits="last")
            seconds.append(watch.elapsed)
            if position == state.cached_len:
                state.cached_len = position + 1
                self.model.commit(seq, state.cached_len)
        return seconds

    def forget(self, seq: int) -> None:
        """The sequence left the pool (the scheduler freed its blocks): drop its bookkeeping."""
        self._states.pop(seq, None)

    def _pass(self, seqs: list[int], inputs: list[torch.Tensor], starts: list[int]) -> torch.Tensor:
        """Feed row b ``inputs[b]`` (T_b,) at positions starts[b]..; logits (B, V) of each row's last token."""
        for seq, x, start in zip(seqs, inputs, starts, strict=True):
            self.cache.reserve(seq, start + x.shape[0])
        logits = self.model.forward(seqs, inputs, starts, logits="last")
        assert logits is not None
        # Lengths are settled in on_verified, which keeps the accepted drafts' slots and frees the rest.
        return to_target_vocab(logits, self.target_vocab_size)

    def propose(self, rows: Sequence[DraftRow]) -> tuple[list[DraftProposal], int]:
        """Drafts for every row (row b gets up to ``rows[b].num_tokens``) and the passes run."""
        if not rows:
            return [], 0
        tokens: list[list[torch.Tensor]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        states = [self._states[row.seq] for row in rows]
        passes = self._read_ahead(rows, states)
        # Catch up on committed tokens the draft has not seen, then one token per pass.
        logits = self._pass(
            [row.seq for row in rows],
            [row.committed[state.cached_len :] for row, state in zip(rows, states, strict=True)],
            [state.cached_len for state in states],
        )
        passes += 1
        active = list(range(len(rows)))
        step = 0
        while True:
            confidences: list[torch.Tensor] = []
            for i, row_logits in zip(active, logits, strict=True):
                row = rows[i]
                token, q = draw(row_logits[None], row.processor, row.generator)
                tokens[i].append(token)
                if q is not None:
                    probs[i].append(q)
                if row.confidence_threshold > 0:
                    confidences.append(draft_confidence(row_logits[None], q, token))
            step += 1
            doubtful: set[int] = set()
            if confidences:
                # One host read per pass for every row that has a cut-off (a sync on GPUs).
                values = iter(torch.cat(confidences).tolist())
                doubtful = {i for i in active if rows[i].confidence_threshold > 0 and next(values) < rows[i].confidence_threshold}
            active = [i for i in active if rows[i].num_tokens > step and i not in doubtful]
            if not active:
                break
            logits = self._pass(
                [rows[i].seq for i in active],
                [tokens[i][-1] for i in active],
                [rows[i].committed.shape[0] + step - 1 for i in active],
            )
            passes += 1
        proposals = []
        for row, state, row_tokens, row_probs in zip(rows, states, tokens, probs, strict=True):
            state.proposed_base = row.committed.shape[0]
            state.proposed_count = len(row_tokens)
            proposals.append(DraftProposal(
                tokens=torch.stack(row_tokens, dim=1),
                probs=torch.stack(row_probs, dim=1) if row_probs else None,
                forward_passes=passes,
            ))
        return proposals, passes

    def on_verified(self, seq: int, num_accepted: int) -> None:
        """Keep the committed prefix plus the accepted drafts that were fed (all but the last)."""
        state = self._states[seq]
        valid = state.proposed_base + min(num_accepted, state.proposed_count - 1)
        self.model.commit(seq, valid)
        state.cached_len = valid
