"""Our ``Transformer`` over a paged KV pool: the torch backend's ``BatchModel``.

Every row of a pass is padded to the longest (``PagedKVCache.view`` sends padding writes to the
null block), so one call of the model serves the whole batch whatever each row feeds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode.backends.base import BatchModel
from specdecode.core.device import host_to_device
from specdecode.core.timing import COST_PROBE_CONTEXT, best_seconds
from specdecode.kv.paged import DEFAULT_BLOCK_SIZE, PagedKVCache, stack_padded
from specdecode.models.llama import ModelOutput, Transformer


class PagedBatchModel:
    backend = "torch"
    merges_prefill = False  # padded rows: a prompt fed with the verify rows would pad every row to it
    supports_trees = True  # per-row tree attention masks over the paged pool (kv/paged.py)

    def __init__(self, model: Transformer, pool: PagedKVCache) -> None:
        self.model = model
        self.pool = pool

    @classmethod
    def with_pool(
        cls, model: Transformer, kv_cache_tokens: int, block_size: int = DEFAULT_BLOCK_SIZE, kv_dtype: str = "auto"
    ) -> PagedBatchModel:
        """``model`` over a fresh pool of ``kv_cache_tokens`` slots (plus the null block), stored as
        ``kv_dtype`` (``KV_DTYPES``): "int8" holds as many tokens in about half the bytes of a
        bf16/fp16 pool (``kv/paged.py``)."""
        num_blocks = kv_cache_tokens // block_size + 1
        return cls(model, PagedKVCache(model.config, num_blocks, model.dtype, model.device, block_size, kv_dtype))

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def forward(
        self,
        seqs: Sequence[int],
        inputs: Sequence[torch.Tensor],  # B tensors, (T_b,) long each
        starts: Sequence[int],
        logits: str = "all",
        logit_rows: Sequence[int] | None = None,
        trees: Sequence[Sequence[int] | None] | None = None,
        layers: Sequence[int] | None = None,
    ) -> torch.Tensor | None:
        """``BatchModel.forward``; ``layers``: the layers to run, in order (None: all), for
        self-speculation (``drafters/batch_layer_skip.py``): a skipped layer neither reads nor
        writes the pool."""
        if logit_rows is not None and logits != "all":
            raise ValueError("logit_rows goes with logits='all'")
        if logits == "all" and logit_rows is None:
            return self._run(seqs, inputs, starts, trees, layers, compute_logits=True).logits  # (B, T_max, V)
        hidden = self._run(seqs, inputs, starts, trees, layers, compute_logits=False).hidden  # (B, T_max, C)
        if logits == "none":
            return None
        if logit_rows is not None:
            return self._row_logits(hidden, inputs, logit_rows)
        # Only each row's last token goes through the head: a draft step's logits, not T_max rows.
        last = host_to_device([x.shape[0] - 1 for x in inputs], torch.long, hidden.device)
        return self.model.lm_head(hidden[torch.arange(len(inputs), device=hidden.device), last]).float()  # (B, V)

    def forward_features(
        self,
        seqs: Sequence[int],
        inputs: Sequence[torch.Tensor],  # B tensors, (T_b,) long each
        starts: Sequence[int],
        logits: bool = True,
        trees: Sequence[Sequence[int] | None] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``forward`` with every row's logits (or none), and the final hidden states too:
        (B, T_max, V) float or None, and (B, T_max, C), row b's token j at [b, j]. Medusa and
        EAGLE heads draft from them (``drafters/base.py: TreeDrafter.observe``)."""
        out = self._run(seqs, inputs, starts, trees, None, compute_logits=logits)
        return out.logits, out.hidden

    def _run(
        self,
        seqs: Sequence[int],
        inputs: Sequence[torch.Tensor],  # B tensors, (T_b,) long each
        starts: Sequence[int],
        trees: Sequence[Sequence[int] | None] | None,
        layers: Sequence[int] | None,
        compute_logits: bool,
    ) -> ModelOutput:
        host_positions = [list(range(start, start + x.shape[0])) for x, start in zip(inputs, starts, strict=True)]
        view, positions = self.pool.view(list(seqs), host_positions, self.model.config.sliding_window, trees)
        return self.model(
            stack_padded(list(inputs)), positions, view, view, layers=layers, compute_logits=compute_logits
        )

    def _row_logits(
        self,
        hidden: torch.Tensor,  # (B, T_max, C)
        inputs: Sequence[torch.Tensor],  # B tensors, (T_b,) long each
        logit_rows: Sequence[int],
    ) -> torch.Tensor:  # (B, max r_b, V)
        """Logits of row b's last ``logit_rows[b]`` tokens."""
        # Row b's last r_b tokens first, then (padding) its last token again, zeroed below.
        counts = [min(rows, x.shape[0]) for rows, x in zip(logit_rows, inputs, strict=True)]
        width = max(counts)
        index = [
            [x.shape[0] - count + min(j, count - 1) for j in range(width)]
            for x, count in zip(inputs, counts, strict=True)
        ]
        picked = torch.gather(
            hidden, 1, host_to_device(index, torch.long, hidden.device)[..., None].expand(-1, -1, hidden.shape[-1])
        )  # (B, width, C)
        kept = self.model.lm_head(picked).float()  # (B, width, V)
        pad = host_to_device([[j >= count for j in range(width)] for count in counts], torch.bool, hidden.device)
        return kept.masked_fill(pad[..., None], 0.0)

    def commit(self, seq: int, length: int) -> None:
        self.pool.commit(seq, length)

    def keep_path(self, seq: int, root: int, path: Sequence[int]) -> None:
        self.pool.keep_path(seq, root, path)

    @torch.inference_mode()
    def pass_seconds(self, shapes: Sequence[tuple[int, int]], repeats: int) -> dict[tuple[int, int], float]:
        """Each (B, T) pass timed on a scratch pool, each sequence holding ``COST_PROBE_CONTEXT``
        tokens first (so attention reads something, as in decoding)."""
        model = self.model
        most_batch = max(b for b, _ in shapes)
        per_sequence = COST_PROBE_CONTEXT + max(t for _, t in shapes)
        # Stored as the real pool is: an int8 pool's passes pay for quantizing and dequantizing.
        pool = PagedKVCache(
            model.config,
            most_batch * (per_sequence // DEFAULT_BLOCK_SIZE + 1) + 1,
            model.dtype,
            model.device,
            kv_dtype=self.pool.kv_dtype,
        )
        for seq in range(most_batch):
            pool.add(seq)
            pool.reserve(seq, per_sequence)
        measured = {}
        for batch, width in shapes:
            view, positions = pool.view(
                list(range(batch)), [list(range(COST_PROBE_CONTEXT, COST_PROBE_CONTEXT + width))] * batch
            )
            tokens = torch.zeros((batch, width), dtype=torch.long, device=model.device)
            measured[(batch, width)] = best_seconds(
                lambda t=tokens, p=positions, v=view: model(t, p, v, v), model.device, repeats
            )
        return measured


def as_batch_model(
    model: Transformer | BatchModel, kv_cache_tokens: int, block_size: int, kv_dtype: str = "auto"
) -> BatchModel:
    """A batch engine's model: our ``Transformer`` over a fresh paged pool of ``kv_cache_tokens``
    slots stored as ``kv_dtype``, or a backend's ``BatchModel`` (llama.cpp), which comes with its
    own pool, as given (``kv_dtype`` is then ignored: the decoder refuses int8 on llama.cpp)."""
    if isinstance(model, Transformer):
        return PagedBatchModel.with_pool(model, kv_cache_tokens, block_size, kv_dtype)
    return model
