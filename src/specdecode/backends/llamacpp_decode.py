"""The token batch a llama.cpp model feeds to ``llama_decode``, the copy of its logits out, and
the parameters of its context.

One ``llama_batch`` serves a model for its lifetime. Each token is one sequence's, so every
token's ``n_seq_id`` is 1 and only the first entry of its sequence-id array is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

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


def context_params(
    llama_cpp: ModuleType, cells: int, n_seq_max: int, n_batch: int, n_ubatch: int, kv_unified: bool, n_threads: int,
    kv_type: str, flash_attn: bool | None,
) -> Any:
    """``llama_context_params`` for a context of ``cells`` KV cells shared by ``n_seq_max``
    sequences (``LlamaCppModel``'s arguments), logits for every row a pass asks for."""
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = cells
    params.n_batch = n_batch
    params.n_ubatch = n_ubatch
    params.n_seq_max = n_seq_max
    params.kv_unified = kv_unified
    params.n_outputs_max = 0  # 0: up to n_batch logit rows per pass
    params.n_outputs_max_per_seq = 0  # default 1 in 0.3.36; verification needs a row per token
    params.n_threads = n_threads
    params.n_threads_batch = n_threads
    params.embeddings = False
    kv_ggml_type = llama_cpp.GGML_TYPE_F16 if kv_type == "f16" else llama_cpp.GGML_TYPE_F32
    params.type_k = kv_ggml_type
    params.type_v = kv_ggml_type
    params.flash_attn_type = {
        None: llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO,
        True: llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
        False: llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
    }[flash_attn]
    return params
