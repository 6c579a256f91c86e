"""The llama.cpp backend behind the engine's ``SequenceModel`` interface, and loading a GGUF for it.

``LlamaCppSequence`` decodes one sequence (llama.cpp sequence id 0) of a ``LlamaCppModel``:
``extend`` feeds token ids at positions and returns float32 logits as torch tensors (one
copy out of llama.cpp's buffer), ``commit`` removes the positions past the valid length from
llama.cpp's memory. The engine's invariant (the cache holds exactly the positions before the
next pass's first) is what llama.cpp itself demands of a batch, so a rejected draft costs one
``llama_memory_seq_rm`` and nothing else.

The tokenizer stays ours (rebuilt from the GGUF's metadata, ``models/gguf_tokenizer.py``):
it has the chat template and incremental detokenisation the engine uses, over the same ids.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from specdecode.backends.llamacpp import LlamaCppModel
from specdecode.backends.llamacpp_repack import repack_choice
from specdecode.config import ModelConfig
from specdecode.core.timing import COST_PROBE_CONTEXT, best_seconds
from specdecode.errors import InvalidRequestError
from specdecode.models.gguf_tokenizer import cached_tokenizer_folder
from specdecode.models.loader import LoadedModel, gguf_source, load_tokenizer

# Positions one sequence may hold: llama.cpp allocates the KV cache for them up front, so the
# model's trained context (32k for Qwen2.5) would cost memory no request here uses.
DEFAULT_CONTEXT = 8192
SEQUENCE = 0  # the one llama.cpp sequence id a single-request engine decodes in
# Passes here take tens of milliseconds, and whether drafting can pay at all turns on the
# ratio of a few of them (costs.k_policy.speculation_can_pay): time each shape a few more
# times than the torch default, so one disturbed sample does not decide it.
COST_REPEATS = 4
LONG_PASS_ROWS = 12  # from this many rows a pass is long enough to time with the caller's repeats


class PassLogits:
    """A pass's output as the engine reads it (``backends.base.PassOutput``)."""

    __slots__ = ("logits", "hidden")

    def __init__(self, logits: torch.Tensor | None) -> None:  # logits: (1, T_logits, V)
        self.logits = logits
        self.hidden = None  # llama.cpp's hidden states are not read: heads need the torch backend


class LlamaCppSequence:
    backend = "llama.cpp"
    supports_trees = False  # llama.cpp's batches have no tree attention mask here
    merges_prefill = True

    def __init__(self, model: LlamaCppModel) -> None:
        self.model = model

    @property
    def epoch(self) -> int:
        """Sequences begun and scratch passes run on this context (backends/base.py), by any
        wrapper of the same model."""
        return self.model.sequence_epoch

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def begin(self, capacity: int, keep: int = 0) -> None:
        if capacity > self.model.n_ctx:
            raise InvalidRequestError(
                f"This request needs {capacity} positions but the llama.cpp context holds {self.model.n_ctx}; "
                "shorten the prompt or lower max_new_tokens."
            )
        self.model.sequence_epoch += 1
        if keep:
            self.model.truncate(SEQUENCE, keep)  # the cached prefix stays in llama.cpp's memory
        else:
            self.model.clear(SEQUENCE)

    def extend(
        self,
        tokens: torch.Tensor,  # (1, T) long, on the CPU
        start: int,
        *,
        logits_last: int | None = None,
        compute_logits: bool = True,
    ) -> PassLogits:
        ids = tokens[0].tolist()
        if not compute_logits:
            self.model.forward(SEQUENCE, ids, start, "none")
            return PassLogits(None)
        if logits_last == 1:
            return PassLogits(self.model.forward(SEQUENCE, ids, start, "last")[None])
        # Only the rows asked for go through the output layer (a fifth of a one-row pass each).
        mode = "all" if logits_last is None or logits_last >= len(ids) else logits_last
        return PassLogits(self.model.forward(SEQUENCE, ids, start, mode)[None])

    def commit(self, length: int) -> None:
        self.model.truncate(SEQUENCE, length)

    def pass_seconds(self, row_counts: Sequence[int], repeats: int, logits_last: int | None = None) -> dict[int, float]:
        # On the request's own sequence id, before the request starts (the engine begins it
        # afresh): llama.cpp gives each sequence its own memory, so a scratch one would cost a
        # second KV cache.
        self.model.sequence_epoch += 1
        self.model.clear(SEQUENCE)
        self.model.forward(SEQUENCE, [0] * COST_PROBE_CONTEXT, 0, "none")
        mode = "last" if logits_last == 1 else "all"
        # Short passes take the best of more tries: a thread waking late is a larger share of them.
        measured = {
            rows: best_seconds(lambda: self.model.forward(SEQUENCE, [0] * rows, COST_PROBE_CONTEXT, mode), self.device,
                               max(repeats, COST_REPEATS) if rows < LONG_PASS_ROWS else repeats)
            for rows in row_counts
        }
        self.model.clear(SEQUENCE)
        return measured


def load_llamacpp_model(
    name: str, *, exact: bool = False, context: int = DEFAULT_CONTEXT, show_progress: bool = True
) -> LoadedModel:
    """A GGUF model (a demo name, a .gguf file, or a folder holding one) on llama.cpp.

    ``exact`` (the API's ``dtype="fp32"``) keeps the KV cache in f32 and turns flash attention
    off, whose CPU kernel rounds through f16: logits then match an fp32 torch run of the same
    file to ~1e-5 instead of ~5e-3. The default is llama.cpp's own (f16 cache, flash attention).
    ``context``: the positions the single-request engine may use, capped at the model's trained
    context; a draft model needs no more than its target's.
    """
    path = gguf_source(name, show_progress=show_progress)
    if path is None:
        raise InvalidRequestError(
            f"The llama.cpp backend runs GGUF files; {name!r} is not one (a Hugging Face folder or hub id). "
            'Use backend="torch" for it.'
        )
    folder = cached_tokenizer_folder(path, show_progress=show_progress)
    tokenizer = load_tokenizer(folder)
    if show_progress:
        repack = repack_choice(path, show_progress=True)  # probes AMX here if it is the machine's first load
        print(f"specdecode: loading {name} on llama.cpp ({path.name}; {repack.describe()})", file=sys.stderr, flush=True)
    # The single-request engine's context (its KV) is made at first use: a server decodes in its
    # batch engine's contexts only, and this one's would hold 224 MiB (the demo target's) unused.
    model = LlamaCppModel(path, n_ctx=context, kv_type="f32" if exact else "f16", flash_attn=False if exact else None,
                          lazy=True)
    info = model.describe()
    if 0 < info["n_ctx_train"] < context:
        # llama.cpp keeps the KV of all n_ctx positions from the start (the demo target's: 28 KiB
        # a position): none for positions past what the model was trained for.
        context = model.n_ctx = info["n_ctx_train"]  # before the context exists
    config = ModelConfig(
        model_type=info["architecture"], vocab_size=model.vocab_size, hidden_size=info["n_embd"],
        intermediate_size=0, num_layers=info["n_layer"], num_heads=info["n_head"], num_kv_heads=info["n_head_kv"],
        head_dim=info["n_embd"] // max(info["n_head"], 1), rms_norm_eps=0.0, rope_theta=0.0,
        max_position_embeddings=context, tie_word_embeddings=False, attention_bias=False,
        eos_token_ids=tuple(info["eos_token_ids"]),
    )
    return LoadedModel(name=name, folder=Path(folder), model=model, tokenizer=tokenizer, config=config, backend="llama.cpp")
