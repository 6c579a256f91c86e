"""Prefill in the batch engine: admitted sequences' prompts (past their cached prefix) fed in
chunks, one padded target pass per step for all of them, while the batch keeps decoding."""

from __future__ import annotations

import time

from specdecode.backends.base import BatchModel
from specdecode.backends.torch_batch import PagedBatchModel
from specdecode.drafters.batch_draft import BatchDraftModel
from specdecode.engine.batch_request import BatchRequest
from specdecode.engine.scheduler import ScheduledSequence


def prefill(
    target: BatchModel,
    drafter: BatchDraftModel | None,
    seqs: list[ScheduledSequence],
    prefill_chunk: int,
    prefilling: list[ScheduledSequence],
) -> None:
    """Fill admitted (or readmitted) sequences' target caches with their committed tokens but
    the last, which the first verify pass feeds, from where their cached prefix (or their last
    chunk) ends: one padded pass for all of them, of at most ``prefill_chunk`` tokens in all,
    shortest remaining first, so a long prompt is prefilled over several steps while the
    batch keeps decoding. A sequence whose prefill ends here decodes in this step; the draft
    model reads it the first time it drafts (``BatchDraftModel.add``).

    On a flat batch (``merges_prefill``, llama.cpp) a prompt's last chunk is not fed here but
    in this step's verify pass, before the last token and the drafts (``verify_pass``): its first
    token then costs one pass, as llama-server's does, not a prefill and a pass."""
    started = time.perf_counter()
    budget = prefill_chunk or None
    chunks: list[tuple[ScheduledSequence, int, int]] = []  # (sequence, first position, end)
    for seq in sorted(seqs, key=lambda seq: len(seq.state.tokens) - seq.prefilled):
        end = len(seq.state.tokens) - 1
        if budget is not None:
            end = min(end, seq.prefilled + budget)
            budget -= end - seq.prefilled
        chunks.append((seq, seq.prefilled, end))
    merge = target.merges_prefill
    fed = {seq.seq_id for seq, start, end in chunks
           if end > start and not (merge and end == len(seq.state.tokens) - 1)}
    rows = [(seq, start, end) for seq, start, end in chunks if seq.seq_id in fed]
    if rows:
        seq_ids = [seq.seq_id for seq, _, _ in rows]
        inputs = [seq.state.committed[start:end] for seq, start, end in rows]
        starts = [start for _, start, _ in rows]
        if any(seq.state.heads is not None for seq, _, _ in rows):  # trained heads read the prompt's features
            assert isinstance(target, PagedBatchModel)
            _, hidden = target.forward_features(seq_ids, inputs, starts, logits=False)  # (B, T_max, C)
            for b, (seq, start, end) in enumerate(rows):
                if seq.state.heads is not None:
                    seq.state.heads.observe(hidden[b : b + 1, : end - start], start)
        else:
            target.forward(seq_ids, inputs, starts, logits="none")
    elapsed = time.perf_counter() - started
    for seq, start, end in chunks:
        request: BatchRequest = seq.state
        if seq.seq_id in fed:
            seq.prefilled = end
            request.stats.target_forward_passes += 1
            request.stats.prefill_seconds += elapsed
        target.commit(seq.seq_id, seq.prefilled)
        # What it has computed is findable by requests admitted later, while it still runs
        # (chunk by chunk: a request waiting for this prefix is admitted once it is done).
        target.pool.register(seq.seq_id, request.tokens, seq.cache_group)
        if end < len(request.tokens) - 1:  # chunks to come
            # A paged pool's commit frees the blocks past ``end``: take back those of the
            # prompt's coming chunks now (nothing was admitted in between, so they are free);
            # a step with no decoding row never reaches the step's own reserve.
            target.pool.reserve(seq.seq_id, len(request.tokens))
            continue
        if seq in prefilling:
            prefilling.remove(seq)
        if request.stats.new_tokens == 0:  # a readmission after preemption is not the prompt's hit
            request.stats.cached_tokens = seq.cached_target
        if seq.uses_draft:
            assert drafter is not None
            drafter.add(seq.seq_id, cached=seq.cached_draft)  # reads the rest when it first drafts


def prefill_isolated(
    target: BatchModel,
    drafter: BatchDraftModel | None,
    seqs: list[ScheduledSequence],
    prefill_chunk: int,
    prefilling: list[ScheduledSequence],
) -> list[tuple[ScheduledSequence, Exception]]:
    """``prefill`` of admitted sequences together; if that fails, one at a time: those that fail
    alone, with their errors, for the engine to fail (a prefill writes only its own sequences'
    caches, by position, so a retry repeats nothing another sequence depends on)."""
    try:
        prefill(target, drafter, seqs, prefill_chunk, prefilling)
    except Exception:  # noqa: BLE001 - retried one sequence at a time to find the one to blame
        broken = []
        for seq in list(seqs):
            try:
                prefill(target, drafter, [seq], prefill_chunk, prefilling)
            except Exception as err:  # noqa: BLE001 - any error of a request's own prompt is that request's
                broken.append((seq, err))
        return broken
    return []
