"""A GGUF model decoding many sequences in one ``llama_decode``: the llama.cpp ``BatchModel``.

llama.cpp keeps each sequence of a context in its own KV stream of ``n_ctx`` positions
(``LlamaCppModel`` creates contexts with ``kv_unified=False``), so there are no blocks to page:
the pool is the context's ``n_seq_max`` sequence slots, and a sequence fits when it needs at
most ``n_ctx`` positions. A slot is taken when the scheduler adds a sequence and cleared when
it leaves; rollback is ``llama_memory_seq_rm`` (``LlamaCppModel.truncate``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode.backends.llamacpp import LlamaCppModel
from specdecode.costs.timing import COST_PROBE_CONTEXT, best_seconds
from specdecode.kv.paged import OutOfBlocks

FILLER_TOKEN = 0  # what timing passes feed: their cost does not depend on the ids


class SlotPool:
    """The sequence slots of one llama.cpp context, accounted as one-slot "blocks" of ``n_ctx``
    positions (``backends.base.SequencePool``)."""

    def __init__(self, model: LlamaCppModel) -> None:
        self.model = model
        self.block_size = model.n_ctx
        self._free = list(range(model.n_seq_max - 1, -1, -1))  # popped from the end: slot 0 first
        self.slots: dict[int, int] = {}  # scheduler sequence id -> llama.cpp sequence id

    @property
    def usable_blocks(self) -> int:
        return self.model.n_seq_max

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return len(self.slots)

    def fits(self, tokens: int) -> bool:
        return tokens <= self.model.n_ctx

    def capacity_tokens(self) -> int:
        return self.model.n_ctx

    def blocks_needed(self, seq: int | None, tokens: int) -> int:
        return 0 if seq is not None and seq in self.slots else 1

    def add(self, seq: int) -> None:
        if seq in self.slots:
            raise ValueError(f"sequence {seq} already has a llama.cpp slot")
        if not self._free:
            raise OutOfBlocks("every llama.cpp sequence slot is in use")
        slot = self._free.pop()
        self.model.clear(slot)
        self.slots[seq] = slot

    def reserve(self, seq: int, tokens: int) -> None:
        if tokens > self.model.n_ctx:
            raise OutOfBlocks(f"sequence {seq} needs {tokens} positions; a llama.cpp slot holds {self.model.n_ctx}")

    def commit(self, seq: int, length: int) -> None:
        self.model.truncate(self.slots[seq], length)

    def free(self, seq: int) -> None:
        slot = self.slots.pop(seq, None)
        if slot is not None:
            self.model.clear(slot)
            self._free.append(slot)


class LlamaCppBatchModel:
    backend = "llama.cpp"

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
    ) -> torch.Tensor | None:
        requests = [(self.pool.slots[seq], x.tolist(), start, logits) for seq, x, start in zip(seqs, inputs, starts, strict=True)]
        rows = self.model.forward_batch(requests)
        if logits == "none":
            return None
        if logits == "last":
            return torch.cat(rows)  # (B, V): one row per request
        width = max(x.shape[0] for x in inputs)
        if all(row.shape[0] == width for row in rows):
            return torch.stack(rows)
        out = torch.zeros((len(rows), width, self.vocab_size), dtype=torch.float32)  # rows past T_b: padding
        for b, row in enumerate(rows):
            out[b, : row.shape[0]] = row
        return out

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
        return measured
