"""Self-speculation for many sequences at once: the target drafts with layers skipped, in the
batch engine's paged pool.

The batched twin of ``LayerSkipDrafter`` (drafters/layer_skip.py), with the same cache rule: a
row's committed positions hold the full model's K/V in every layer, each draft pass writes its
one token's K/V in the kept layers only, at positions L - 1, L, ... past the committed length,
and the step's verify pass feeds those positions through every layer and overwrites them. So
there is nothing to roll back and nothing kept per sequence; the engine has reserved the slots
(``BatchEngine.step``: a row's reservation covers its drafts before any pass writes them).

One pass serves every drafting row: pass j feeds each row still drafting its last committed
token (j = 0) or its last draft, one token a row. Sampling is per row, with that request's
processor and generator, so each row's q is the distribution its drafts were drawn from and
verification stays lossless row by row. A row stops early where its draft doubts its own token
(``confidence_threshold``, as for the draft model), decided from the draft's side only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode.backends.torch_batch import PagedBatchModel
from specdecode.core.sampling import draw
from specdecode.drafters.base import DraftProposal
from specdecode.drafters.batch_draft import DraftRow
from specdecode.drafters.draft_model import draft_confidence
from specdecode.drafters.layer_skip_file import check_skip_layers


class BatchLayerSkip:
    def __init__(self, target: PagedBatchModel, skip_layers: Sequence[int]) -> None:
        num_layers = target.model.config.num_layers
        self.target = target  # the target itself, over the batch's pool
        self.skip_layers = check_skip_layers(skip_layers, num_layers)
        self.kept_layers = tuple(i for i in range(num_layers) if i not in self.skip_layers)
        # A draft pass's cost as a fraction of a target pass (the batch's chooser prices drafts
        # with it): the layers dominate; the embedding and the head, run either way, are left out.
        self.pass_fraction = len(self.kept_layers) / num_layers

    def propose(self, rows: Sequence[DraftRow]) -> tuple[list[DraftProposal], int]:
        """Drafts for every row (row b up to ``rows[b].num_tokens``) and the passes run."""
        if not rows:
            return [], 0
        tokens: list[list[torch.Tensor]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        active = list(range(len(rows)))
        # Each row's input this pass: its last committed token (not yet in the pool), then its last draft.
        feed = [row.committed[-1:] for row in rows]
        passes = 0
        while active:
            logits = self.target.forward([rows[i].seq for i in active], [feed[i] for i in active],
                                         [rows[i].committed.shape[0] - 1 + passes for i in active],
                                         logits="last", layers=self.kept_layers)  # (R, V)
            assert logits is not None
            passes += 1
            confidences: list[torch.Tensor] = []
            for i, row_logits in zip(active, logits, strict=True):
                row = rows[i]
                token, q = draw(row_logits[None], row.processor, row.generator)  # (1,), (1, V) | None
                tokens[i].append(token)
                feed[i] = token
                if q is not None:
                    probs[i].append(q)
                if row.confidence_threshold > 0:
                    confidences.append(draft_confidence(row_logits[None], q, token))
            doubtful: set[int] = set()
            if confidences:  # one host read per pass for the rows that have a cut-off
                values = iter(torch.cat(confidences).tolist())
                doubtful = {i for i in active if rows[i].confidence_threshold > 0
                            and next(values) < rows[i].confidence_threshold}
            active = [i for i in active if rows[i].num_tokens > passes and i not in doubtful]
        return [DraftProposal(tokens=torch.stack(row_tokens, dim=1),
                              probs=torch.stack(row_probs, dim=1) if row_probs else None,
                              forward_passes=len(row_tokens))
                for row_tokens, row_probs in zip(tokens, probs, strict=True)], passes
