"""A GGUF model decoding many sequences in one ``llama_decode``: the llama.cpp ``BatchModel``.

llama.cpp sizes a context's KV cache for ``n_seq_max`` sequences of ``n_ctx`` positions and
places each token in a cell itself, so there are no blocks to page: the pool is the context's
``n_seq_max`` sequence slots, and a sequence fits when it needs at most ``n_ctx`` positions. A
slot is taken when the scheduler adds a sequence; rollback is ``llama_memory_seq_rm``
(``LlamaCppModel.truncate``). The cache is unified (``LlamaCppModel``'s ``kv_unified``), so a
step's rows, of any lengths, run as one micro-batch.

Prefix caching, as llama-server's slots do it: a sequence that leaves keeps its K/V in its slot,
with a record of its committed tokens and cache group. A new sequence takes the free slot whose
record shares the longest prefix with its tokens in its group (cut after that prefix: its last
token is always computed), else the slot freed longest ago. A free slot's prefix costs nothing.
A running sequence's slot is a source too: when it holds a longer prefix in the group (at least
``copy_min_tokens`` more), the new sequence takes a free slot and copies the running one's K/V
into it (``LlamaCppModel.copy_sequence``: in the unified cache it shares the prefix's cells). So
requests sharing a system prompt compute it once even while the first of them still decodes
(the scheduler holds back a request whose prefix another is still prefilling:
engine/scheduler.py). ``fork`` copies the same way for n samples of one prompt.

Preemption (engine/scheduler.py): a preempted sequence's slot is kept for it (``free(...,
returning=True)``); others take it only when no other slot is free, and then its K/V are first
saved to host memory (``llama_state_seq_get_data``, ~80 ms for 300 positions of the demo target)
and restored into whichever slot it gets back (~5 ms), so it resumes without recomputing.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specdecode.backends.llamacpp import LlamaCppModel, output_rows
from specdecode.core.prefix import common_prefix_length
from specdecode.core.timing import COST_PROBE_CONTEXT, best_seconds
from specdecode.kv.paged import OutOfBlocks, PrefixCacheStats

FILLER_TOKEN = 0  # what timing passes feed: their cost does not depend on the ids
# Without a unified cache a copy moves a whole KV stream of n_ctx positions: measured on the demo
# target, 2,048 positions copied in 12-14 ms, where prefilling one token took 15 ms (2-core CPU).
# Such a copy is taken when it saves at least n_ctx / COPY_POSITIONS_PER_TOKEN prompt tokens: an
# 8x margin. In a unified cache a copy moves no data (the sequences share cells): one token pays.
COPY_POSITIONS_PER_TOKEN = 256


@dataclass(slots=True)
class SlotRecord:
    """What a free slot's KV holds: the committed tokens of the sequence that left it."""

    tokens: tuple[int, ...]  # every one with its K/V in the slot
    group: str | None
    # A preempted sequence that will be readmitted: the slot waits for it, and other sequences
    # take it only when no other slot is free, saving its K/V to host memory first (``add``).
    owner: int | None = None


@dataclass(slots=True)
class SavedSequence:
    """A preempted sequence's K/V, saved to host memory when its slot was needed."""

    data: ctypes.Array  # LlamaCppModel.save_sequence
    tokens: tuple[int, ...]
    group: str | None


class SlotPool:
    """The sequence slots of one llama.cpp context, accounted as one-slot "blocks" of ``n_ctx``
    positions (``backends.base.SequencePool``), each keeping its last sequence's K/V for the next
    one that shares its prefix (the module docstring)."""

    def __init__(self, model: LlamaCppModel) -> None:
        self.model = model
        self.block_size = model.n_ctx
        self.prefix_cache = True  # the batch engine turns it off (BatchEngine(prefix_cache=False))
        self._free = list(range(model.n_seq_max))  # freed longest ago first
        self.slots: dict[int, int] = {}  # scheduler sequence id -> llama.cpp sequence id
        self.lengths: dict[int, int] = {}  # slot -> committed positions
        self.records: dict[int, SlotRecord] = {}  # free slot -> what its KV holds
        self.prefix_stats = PrefixCacheStats()
        # Preempted sequences whose slot another took: their K/V in host memory, at most as
        # many positions as the context holds (beyond that a preempted sequence is recomputed).
        self.saved: dict[int, SavedSequence] = {}
        self.saved_limit = model.n_ctx * model.n_seq_max
        self.swaps = 0  # preempted sequences' K/V saved to host memory, since start
        # Running sequences' slots -> (their committed tokens, the engine's live list; their
        # group): a new sequence may copy the first ``lengths[slot]`` positions' K/V.
        self.running: dict[int, tuple[Sequence[int], str | None]] = {}
        self.copy_min_tokens = 1 if model.kv_unified else max(1, model.n_ctx // COPY_POSITIONS_PER_TOKEN)
        self.copies = 0  # prefixes copied from running sequences' slots, since start

    @property
    def usable_blocks(self) -> int:
        return self.model.n_seq_max

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return len(self.slots)

    @property
    def cached_blocks(self) -> int:
        return len(self.records)

    def fits(self, tokens: int) -> bool:
        return tokens <= self.model.n_ctx

    def capacity_tokens(self) -> int:
        return self.model.n_ctx

    def blocks_needed(self, seq: int | None, tokens: int) -> int:
        return 0 if seq is not None and seq in self.slots else 1

    def add(self, seq: int, tokens: Sequence[int] = (), group: str | None = None) -> int:
        """Give ``seq`` a slot: the one it left when it was preempted, if still there, or any with
        its saved K/V restored; else the free one whose kept K/V share the longest prefix with
        ``tokens`` in ``group``, else the one freed longest ago, passing over slots kept for
        other preempted sequences while any other is free; returns the positions kept."""
        if seq in self.slots:
            raise ValueError(f"sequence {seq} already has a llama.cpp slot")
        if not self._free:
            raise OutOfBlocks("every llama.cpp sequence slot is in use")
        own = [slot for slot in self._free if self._owner(slot) == seq]
        saved = self.saved.pop(seq, None)
        # Without this, a new request sharing a system prompt with a preempted one would take
        # its slot for that prefix and leave it a whole context to recompute.
        unkept = [slot for slot in self._free if self._owner(slot) is None]
        candidates = own or unkept or self._free
        # For K/V from elsewhere (restored or copied): a slot holding no record loses no cached prefix.
        blank = next((slot for slot in unkept if slot not in self.records), candidates[0])
        best, kept = candidates[0], 0
        if saved is not None:  # its own slot went to another: any slot, the K/V restored
            best = blank
        elif (self.prefix_cache or own) and len(tokens) > 1:
            self.prefix_stats.queried_tokens += len(tokens) - 1
            for slot in candidates:
                record = self.records.get(slot)
                if record is None or record.group != group:
                    continue
                shared = min(common_prefix_length(record.tokens, tokens), len(tokens) - 1)
                if shared > kept:
                    best, kept = slot, shared
        source, copied = self._running_source(tokens, group, kept) if saved is None and not own else (None, 0)
        if source is not None:  # a running sequence holds more: copy it into a slot without a record
            best = blank
            self._claim(best, seq, reusing=False)
            self.model.copy_sequence(source, best, copied)
            self.copies += 1
            self.prefix_stats.hit_tokens += copied
            self._start(seq, best, tokens, group, copied)
            return copied
        self._claim(best, seq, reusing=kept > 0)
        if saved is not None:
            self.model.restore_sequence(best, saved.data)
            kept = min(common_prefix_length(saved.tokens, tokens), len(tokens) - 1)
        if kept:
            self.model.truncate(best, kept)
            self.prefix_stats.hit_tokens += kept
        else:
            self.model.clear(best)
        self._start(seq, best, tokens, group, kept)
        return kept

    def _start(self, seq: int, slot: int, tokens: Sequence[int], group: str | None, kept: int) -> None:
        self.slots[seq] = slot
        self.lengths[slot] = kept
        self.running[slot] = (tokens, group)

    def _running_source(self, tokens: Sequence[int], group: str | None, kept: int) -> tuple[int | None, int]:
        """The running sequence's slot whose valid K/V share the longest prefix with ``tokens`` in
        ``group``, if it is at least ``copy_min_tokens`` longer than ``kept`` (what a free slot
        gives), and that prefix (never ``tokens``' last token); else (None, 0)."""
        if not self.prefix_cache or len(tokens) < 2:
            return None, 0
        best, longest = None, kept + self.copy_min_tokens - 1
        for slot, (held, held_group) in self.running.items():
            if held_group != group:
                continue
            shared = min(common_prefix_length(held[: self.lengths[slot]], tokens), len(tokens) - 1)
            if shared > longest:
                best, longest = slot, shared
        return (best, longest) if best is not None else (None, 0)

    def _claim(self, slot: int, seq: int, reusing: bool) -> None:
        """Take free ``slot`` for ``seq``: what it kept for another preempted sequence is saved to
        host memory first; other kept K/V count as evicted unless ``seq`` reuses their prefix."""
        self._free.remove(slot)
        record = self.records.pop(slot, None)
        if record is not None and record.owner not in (None, seq):
            self._save(record, slot)
        elif record is not None and not reusing:
            self.prefix_stats.evictions += 1  # a slot's kept K/V dropped for new content

    def _save(self, record: SlotRecord, slot: int) -> None:
        """Keep a preempted sequence's K/V in host memory before its slot is reused (within
        ``saved_limit`` positions; otherwise it will be recomputed)."""
        assert record.owner is not None
        used = sum(len(s.tokens) for s in self.saved.values())
        if used + len(record.tokens) <= self.saved_limit:
            self.saved[record.owner] = SavedSequence(self.model.save_sequence(slot), record.tokens, record.group)
            self.swaps += 1
        else:
            self.prefix_stats.evictions += 1

    def _owner(self, slot: int) -> int | None:
        record = self.records.get(slot)
        return None if record is None else record.owner

    def fork(self, source: int, dest: int, length: int | None = None) -> int:
        """A new sequence ``dest`` in a free slot, holding a copy of ``source``'s first ``length``
        positions (all of its committed ones by default, at most those); returns them. The copy
        (``LlamaCppModel.copy_sequence``) shares the prefix's cells in a unified cache, or copies
        the slot's whole KV stream otherwise, where recomputing the prompt would cost a pass."""
        if dest in self.slots:
            raise ValueError(f"sequence {dest} already has a llama.cpp slot")
        if not self._free:
            raise OutOfBlocks("every llama.cpp sequence slot is in use")
        source_slot = self.slots[source]
        kept = self.lengths[source_slot] if length is None else max(0, min(length, self.lengths[source_slot]))
        # The slot freed longest ago among those without a record, so no cached prefix is lost
        # where an empty slot will do; then one not kept for a preempted sequence.
        slot = next((s for s in self._free if s not in self.records),
                    next((s for s in self._free if self._owner(s) is None), self._free[0]))
        self._claim(slot, dest, reusing=False)
        if kept:
            self.model.copy_sequence(source_slot, slot, kept)
        else:
            self.model.clear(slot)
        self._start(dest, slot, (), None, kept)  # a fork's tokens are the source's: not a source itself
        return kept

    def register(self, seq: int, tokens: Sequence[int], group: str | None = None) -> None:
        """``seq``'s committed tokens (the engine's live list) and group: a new sequence of the
        group may copy its slot's valid K/V (``add``)."""
        if seq in self.slots:
            self.running[self.slots[seq]] = (tokens, group)

    def reserve(self, seq: int, tokens: int) -> None:
        if tokens > self.model.n_ctx:
            raise OutOfBlocks(f"sequence {seq} needs {tokens} positions; a llama.cpp slot holds {self.model.n_ctx}")

    def commit(self, seq: int, length: int) -> None:
        slot = self.slots[seq]
        self.model.truncate(slot, length)
        self.lengths[slot] = length

    def free(self, seq: int, tokens: Sequence[int] = (), group: str | None = None, returning: bool = False) -> None:
        """The sequence left: its slot keeps the K/V of ``tokens`` (its committed tokens) for a
        later sequence of ``group``, or is cleared with the prefix cache off. ``returning`` (it
        was preempted and will be readmitted): the slot is kept for it first (``add``), with
        the prefix cache on or off. A sequence without a slot (one that left the queue) gives up
        the slot kept for it."""
        slot = self.slots.pop(seq, None)
        if slot is None:
            self.saved.pop(seq, None)
            for kept_slot in [s for s, record in self.records.items() if record.owner == seq]:
                if self.prefix_cache:
                    self.records[kept_slot].owner = None
                else:
                    del self.records[kept_slot]
                    self.model.clear(kept_slot)
            return
        self.running.pop(slot, None)
        valid = min(self.lengths.pop(slot, 0), len(tokens))
        if (self.prefix_cache or returning) and valid > 0:
            self.records[slot] = SlotRecord(tuple(tokens[:valid]), group, seq if returning else None)
        else:
            self.model.clear(slot)
        self._free.append(slot)

    def drop_cached_prefixes(self) -> None:
        """Forget the prefixes free slots keep (``SpecDecoder.forget_prefix``), their cells
        cleared; a slot kept for a preempted sequence, and K/V saved for one, are its own state
        to resume from, not a cached prefix, and stay."""
        for slot in [slot for slot, record in self.records.items() if record.owner is None]:
            del self.records[slot]
            self.model.clear(slot)

    def clear_records(self) -> None:
        """Forget what free slots hold (after scratch passes wrote into them)."""
        self.records.clear()
        self.saved.clear()


class LlamaCppBatchModel:
    backend = "llama.cpp"
    merges_prefill = True  # one flat llama_batch: a long row costs its own tokens only
    supports_trees = False  # no per-row tree attention mask in a llama_batch: suffix rows draft chains

    def __init__(self, model: LlamaCppModel) -> None:
        self.model = model
        self.pool = SlotPool(model)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def forward(
        self,
        seqs: Sequence[int],
        inputs: Sequence[torch.Tensor],  # B tensors, (T_b,) long each, on the CPU
        starts: Sequence[int],
        logits: str = "all",
        logit_rows: Sequence[int] | None = None,
    ) -> torch.Tensor | None:
        modes: list[str | int] = [logits] * len(inputs)
        if logit_rows is not None:
            if logits != "all":
                raise ValueError("logit_rows goes with logits='all'")
            modes = list(logit_rows)
        requests = [(self.pool.slots[seq], x.tolist(), start, mode)
                    for seq, x, start, mode in zip(seqs, inputs, starts, modes, strict=True)]
        if logits == "none":
            self.model.forward_batch(requests)
            return None
        # llama.cpp's rows are copied once, straight into the batch's array: (B, V) of each row's
        # last token, or (B, T_max, V) with the rows past each row's own zeroed (padding).
        if logits == "last":
            out = np.empty((len(inputs), self.vocab_size), dtype=np.float32)
            views = [out[b : b + 1] for b in range(len(inputs))]
        else:
            counts = [output_rows(mode, x.shape[0]) for x, mode in zip(inputs, modes, strict=True)]
            out = np.empty((len(inputs), max(counts), self.vocab_size), dtype=np.float32)
            views = []
            for b, count in enumerate(counts):
                out[b, count:] = 0.0
                views.append(out[b, :count])
        self.model.forward_batch(requests, out=views)
        return torch.from_numpy(out)

    def commit(self, seq: int, length: int) -> None:
        self.pool.commit(seq, length)

    def pass_seconds(self, shapes: Sequence[tuple[int, int]], repeats: int) -> dict[tuple[int, int], float]:
        """Each (B, T) pass timed in scratch sequences after ``COST_PROBE_CONTEXT`` positions; the
        slots used are cleared afterwards, so call it before any request decodes."""
        model = self.model
        most_batch = min(max(b for b, _ in shapes), model.n_seq_max)
        filler = [FILLER_TOKEN] * COST_PROBE_CONTEXT
        model.forward_batch([(slot, filler, 0, "none") for slot in range(most_batch)])
        measured = {}
        for batch, width in shapes:
            requests = [(slot, [FILLER_TOKEN] * width, COST_PROBE_CONTEXT, "all") for slot in range(min(batch, most_batch))]
            measured[(batch, width)] = best_seconds(lambda r=requests: model.forward_batch(r), self.device, repeats)
        for slot in range(most_batch):
            model.clear(slot)
        self.pool.clear_records()
        return measured
