"""The token batch a llama.cpp model feeds to ``llama_decode``, and the copy of its logits out.

One ``llama_batch`` serves a model for its lifetime. Each token is one sequence's, so every
token's ``n_seq_id`` is 1 and only the first entry of its sequence-id array is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import numpy as np


class TokenBatch:
    """A ``llama_batch`` of up to ``n_batch`` tokens, written through numpy views of its C
    arrays so filling it costs a few vectorised stores instead of a Python loop over fields."""

    def __init__(self, llama_cpp: ModuleType, n_batch: int) -> None:
        self._llama = llama_cpp
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        n = n_batch
        self._tokens = np.ctypeslib.as_array(self.batch.token, shape=(n,))
        self._positions = np.ctypeslib.as_array(self.batch.pos, shape=(n,))
        self._n_seq_id = np.ctypeslib.as_array(self.batch.n_seq_id, shape=(n,))
        self._wants_logits = np.ctypeslib.as_array(self.batch.logits, shape=(n,))
        self._seq_slots = [self.batch.seq_id[i] for i in range(n)]  # each token's seq id array
        self._n_seq_id[:] = 1

    def fill(self, tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[int], outputs: Sequence[bool]) -> None:
        """Token i is ``tokens[i]`` at ``positions[i]`` of sequence ``seqs[i]``, with a logit
        row when ``outputs[i]``."""
        count = len(tokens)
        self._tokens[:count] = tokens
        self._positions[:count] = positions
        self._wants_logits[:count] = outputs
        slots = self._seq_slots
        for i, seq in enumerate(seqs):
            slots[i][0] = seq
        self.batch.n_tokens = count

    def free(self) -> None:
        self._llama.llama_batch_free(self.batch)


def copy_logits(buffer: np.ndarray, results: list[np.ndarray | None], owners: list[tuple[int, int]]) -> None:
    """Logit rows (``buffer``: llama.cpp's, (rows, V), in batch order) into the result arrays:
    row i goes to ``results[request]`` at ``row`` for ``owners[i] = (request, row)``."""
    # The only copy: straight from llama.cpp's buffer into the arrays the caller returns.
    i = 0
    while i < len(owners):
        request, first_row = owners[i]
        run = 1  # consecutive rows of one request go in one slice copy
        while i + run < len(owners) and owners[i + run][0] == request:
            run += 1
        results[request][first_row : first_row + run] = buffer[i : i + run]
        i += run
