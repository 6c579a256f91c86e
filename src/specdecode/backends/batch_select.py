"""The batch engine's model for a loaded model on its backend (``backends.base.BatchModel``)."""

from __future__ import annotations

from specdecode.backends.base import BatchModel
from specdecode.backends.compiled_batch import BatchGraphs, compiled_batch_model
from specdecode.backends.llamacpp import LlamaCppModel
from specdecode.backends.llamacpp_batch import LlamaCppBatchModel
from specdecode.backends.torch_batch import PagedBatchModel
from specdecode.errors import InvalidRequestError
from specdecode.models.loader import LoadedModel

MIN_SEQUENCE_POSITIONS = 256  # below this a llama.cpp batch slot would refuse most requests


def batch_model(
    loaded: LoadedModel,
    max_batch: int,
    kv_cache_tokens: int,
    block_size: int,
    spare_slots: int = 0,
    kv_dtype: str = "auto",
    compiled: tuple[BatchGraphs, int, str] | None = None,
) -> BatchModel:
    """torch: the model over a paged pool of ``kv_cache_tokens`` slots. llama.cpp: a new context on
    the same file with ``max_batch`` sequences, each of ``kv_cache_tokens // max_batch`` positions
    (at most the model's context): llama.cpp allocates its (unified) KV cache up front, so the
    same total memory is split evenly instead of paged. ``spare_slots`` more
    sequences of that size hold the K/V of requests preempted for fairness (and of finished ones,
    for the prefix cache): ``SchedulerConfig.spare_slots``, KV memory ``spare_slots / max_batch``
    above ``kv_cache_tokens``. ``kv_dtype`` (``KV_DTYPES``): how the torch pool stores K/V, "int8"
    in about half the bytes of a bf16/fp16 pool for the same tokens; llama.cpp ignores it (the
    decoder refuses int8 there). ``compiled`` (torch, with ``compile=``): (the decoder's compiled
    graphs, the most rows a compiled pass takes, the model's role), ``backends/compiled_batch.py``."""
    if max_batch < 1:
        raise InvalidRequestError(f"max_batch must be >= 1, got {max_batch}.")
    if isinstance(loaded.model, LlamaCppModel):
        per_sequence = min(kv_cache_tokens // max_batch, loaded.config.max_position_embeddings)
        if per_sequence < MIN_SEQUENCE_POSITIONS:
            raise InvalidRequestError(
                f"kv_cache_tokens={kv_cache_tokens} over max_batch={max_batch} leaves {per_sequence} positions per "
                f"llama.cpp sequence; give each at least {MIN_SEQUENCE_POSITIONS} (raise kv_cache_tokens or lower max_batch)."
            )
        return LlamaCppBatchModel(loaded.model.with_sequences(max_batch + spare_slots, per_sequence))
    if compiled is not None:
        graphs, max_rows, role = compiled
        return compiled_batch_model(loaded.model, kv_cache_tokens, block_size, graphs=graphs, max_rows=max_rows,
                                    role=role)
    return PagedBatchModel.with_pool(loaded.model, kv_cache_tokens, block_size, kv_dtype)
