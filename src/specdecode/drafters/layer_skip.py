"""Self-speculation: the target drafts with some of its layers skipped.

No second model: the drafter runs the target's own ``Transformer`` with ``layers=`` set to the
layers it keeps, so every weight is shared (nothing is copied) and no extra memory is used.

No draft cache either: the drafter works in the target's KV cache, which the engine hands it at
``start``. The committed positions hold the full model's keys and values for every layer, and
a kept layer attends to them as they are. For the layers before the first skipped one that is
exactly what the draft would compute itself; for later kept layers it is the full model's
(better informed) context. Each draft pass writes the kept layers' K/V of its one token at
positions L - 1, L, ... past the committed length L - 1; the verify pass that follows feeds the
same positions through every layer and overwrites all of them, so nothing needs rolling back
and the cache's committed lengths are never touched here.

Which layers to skip is a measured choice: ``specdecode tune-layerskip`` (``training/layer_search.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode.backends.base import SequenceModel
from specdecode.backends.torch_backend import TorchSequence
from specdecode.core.sampling import LogitsProcessor, draw
from specdecode.drafters.base import DraftProposal
from specdecode.drafters.draft_model import doubts
from specdecode.drafters.layer_skip_file import check_skip_layers
from specdecode.kv.static import KVCache
from specdecode.models.llama import Transformer


class LayerSkipDrafter:
    reads_target_cache = True  # its first proposal needs the prompt's K/V (drafters/base.py)
    def __init__(self, model: Transformer, skip_layers: Sequence[int], confidence_threshold: float = 0.0) -> None:
        self.model = model  # the target itself
        self.skip_layers = check_skip_layers(skip_layers, model.config.num_layers)
        self.kept_layers = tuple(i for i in range(model.config.num_layers) if i not in self.skip_layers)
        self.confidence_threshold = confidence_threshold  # as for the draft model
        self.cache: KVCache | None = None

    def start(self, prompt_len: int, capacity: int, target: SequenceModel | None = None, shared_prefix: int = 0) -> None:
        if not isinstance(target, TorchSequence) or target.model is not self.model or target.cache is None:
            raise ValueError("The layer-skip drafter drafts in the target's own KV cache: start() it with the "
                             "target's torch sequence.")
        self.cache = target.cache

    def propose(
        self,
        committed: torch.Tensor,  # (1, L) long
        num_tokens: int,
        processor: LogitsProcessor,
        generator: torch.Generator | None,
    ) -> DraftProposal:
        assert self.cache is not None
        length = committed.shape[1]
        token = committed[:, length - 1 :]  # (1, 1): the last committed token, not yet in the cache
        tokens: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for step in range(num_tokens):
            out = self.model.extend(self.cache, token, length - 1 + step, layers=self.kept_layers, logits_last=1)
            logits = out.logits[:, -1]  # (1, V)
            next_token, q = draw(logits, processor, generator)
            if q is not None:
                probs.append(q)
            tokens.append(next_token)
            if doubts(logits, q, next_token, self.confidence_threshold):
                break
            token = next_token[:, None]
        return DraftProposal(
            tokens=torch.stack(tokens, dim=1),
            probs=torch.stack(probs, dim=1) if probs else None,
            forward_passes=len(tokens),
        )

    def on_verified(self, num_accepted: int) -> None:
        pass  # the verify pass overwrote every slot a draft pass wrote
