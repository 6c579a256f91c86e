"""EAGLE: a one-layer head drafts at the feature level and grows a dynamic token tree (EAGLE-2).

The head reads pairs (f_p, t_{p+1}): the target's feature at p and the token after it, and
predicts f_{p+1}, whose logits guess t_{p+2} (``models.heads.EagleHead``). It keeps its own
one-layer KV cache over the committed pairs, slot p for pair p (rotated as position p + 1).

Each step, with L committed tokens:
1. **Catch up.** Feed the pairs the head has not read, up to p = L - 2 (the features arrive
   through ``observe``: the prompt's after prefill, the accepted path's after each verify
   pass). The last output is the predicted f_{L-1}; its logits give the root's children.
2. **Expand** (EAGLE-2). Score every drafted node by its cumulative log-probability under
   the head. Per depth, the ``top_k`` best new nodes become the frontier: their pairs
   (parent's predicted feature, own token) run through the head in one batch with tree
   attention (a row sees the committed pairs and its own ancestors' pairs), and each gets its
   ``top_k`` children. Expansion rows go to cache slots past the committed pairs, where the
   next step's catch-up overwrites them, so rollback costs nothing.
3. **Select.** The ``tree_size`` best-scoring nodes of all depths form the tree (a parent
   always scores at least as high as its child; ties are closed over ancestors).

All bookkeeping stays on the device until the one host read of step 3. Children are
deterministic top-k picks: under sampling, tree verification stays lossless (accept with
p(child), remove it from the residual).
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode.backends.base import SequenceModel
from specdecode.backends.device import host_to_device
from specdecode.config import MAX_TREE_SIZE
from specdecode.engine.sampling import LogitsProcessor
from specdecode.engine.tree import NO_PARENT, TokenTree
from specdecode.errors import InvalidRequestError
from specdecode.kv.static import KVCache, KVView
from specdecode.models.heads import EagleHead

# Drafted nodes (root excluded). On this project's 2-core CPU a target pass over 5 rows costs
# ~1.3x one over a single row and 13 rows ~2x, and 4 nodes measured fastest on HumanEval
# prompts (README, "Token trees"); on a GPU, where rows up to dozens cost about the same,
# pass a larger --tree-size (16-60).
DEFAULT_TREE_SIZE = 4
DEFAULT_DEPTH = 5
DEFAULT_TOP_K = 4


class EagleDrafter:
    def __init__(
        self,
        head: EagleHead,
        embed_tokens: nn.Embedding,  # the target's embedding (shared, not copied)
        tree_size: int = DEFAULT_TREE_SIZE,
        depth: int = DEFAULT_DEPTH,
        top_k: int = DEFAULT_TOP_K,
    ) -> None:
        if not 1 <= tree_size <= MAX_TREE_SIZE:
            raise InvalidRequestError(f"tree_size={tree_size} is out of range: use 1..{MAX_TREE_SIZE}.")
        if depth < 1 or top_k < 1:
            raise InvalidRequestError(f"EAGLE needs depth >= 1 and top_k >= 1, got {depth} and {top_k}.")
        self.head = head
        self.embed_tokens = embed_tokens
        self.tree_size, self.depth, self.top_k = tree_size, depth, top_k
        # Ancestors of a tie-broken selection can add at most depth - 1 nodes.
        self.max_tree_nodes = tree_size + depth
        self.last_forward_passes = 0
        self.cache: KVCache | None = None
        self.features: torch.Tensor | None = None  # (capacity, C) the target's features by position
        self.known = 0  # features known for positions [floor, known)
        self.cached = 0  # pairs read into the head's cache: [floor, cached)
        # The first position whose feature was observed: 0, unless the sequence's first positions
        # came from a prefix cache or another sample's prompt (the batch engine), whose features
        # the target never computed for it. The head then attends to the pairs from here on only:
        # drafts read less context; verification, and so the output, is unchanged.
        self.floor = 0
        self._predicted: torch.Tensor | None = None  # (1, C) the last catch-up's predicted f_{cached}

    def start(self, prompt_len: int, capacity: int, target: SequenceModel | None = None, shared_prefix: int = 0) -> None:
        cfg = self.head.config
        dtype, device = self.head.fc.weight.dtype, self.head.fc.weight.device
        slots = capacity + self.depth * self.top_k
        if self.cache is None or self.cache.capacity < slots:
            self.cache = KVCache(1, 1, cfg.num_kv_heads, cfg.head_dim, slots, dtype, device)
        self.cache.reset()
        if self.features is None or self.features.shape[0] < capacity:
            self.features = torch.empty((capacity, cfg.hidden_size), dtype=dtype, device=device)
        self.known = self.cached = self.floor = 0
        self._predicted = None

    def fresh(self) -> EagleDrafter:
        """A drafter of its own for another sequence (the batch engine's rows), sharing the head
        and the embedding; its cache and features are its own."""
        return EagleDrafter(self.head, self.embed_tokens, self.tree_size, self.depth, self.top_k)

    def observe(self, features: torch.Tensor, start: int) -> None:  # features: (1, T, C)
        assert self.features is not None, "start() comes first"
        if start > self.known:  # positions [known, start) were never computed for this sequence
            self.floor = self.cached = start
            self._predicted = None
        self.features[start : start + features.shape[1]] = features[0]
        self.known = start + features.shape[1]

    def _run(
        self,
        features: torch.Tensor,  # (1, R, C)
        tokens: torch.Tensor,  # (1, R) long
        positions: torch.Tensor,  # (1, R) long
        slot: int,
        view: KVView,
    ) -> torch.Tensor:  # (1, R, C) predicted next features
        self.last_forward_passes += 1
        return self.head(features, self.embed_tokens(tokens), positions, self.cache, view, contiguous_start=slot)

    def _catch_up(self, committed: torch.Tensor) -> torch.Tensor:  # committed (1, L) -> (1, C) predicted f_{L-1}
        assert self.cache is not None and self.features is not None
        length = committed.shape[1]
        first, floor = self.cached, self.floor
        rows = length - 1 - first
        if rows == 0:  # read already: the same step drafted again (the batch engine reruns a failed step)
            assert self._predicted is not None
            return self._predicted
        device = committed.device
        positions = torch.arange(first + 1, length, device=device)[None]  # pair p sits at position p + 1
        key_slots = torch.arange(length - 1, device=device)
        # Pair p sees pairs floor .. p.
        mask = (key_slots[None, :] <= torch.arange(first, length - 1, device=device)[:, None]) & (key_slots >= floor)
        view = KVView(kv_len=length - 1, mask=None if rows == 1 and floor == 0 else mask[None, None])
        out = self._run(self.features[first : length - 1][None], committed[:, first + 1 : length], positions, first, view)
        self.cache.commit(0, length - 1)
        self.cached = length - 1
        self._predicted = out[:, -1]
        return self._predicted

    def propose_tree(
        self,
        committed: torch.Tensor,  # (1, L) long
        max_depth: int,
        processor: LogitsProcessor,
        generator: torch.Generator | None,
    ) -> TokenTree:
        self.last_forward_passes = 0
        length = committed.shape[1]
        root = committed[0, -1:]
        # A tree of n nodes is at most n deep: deeper expansions could never be kept.
        depth_limit = min(self.depth, max_depth, self.tree_size)
        # No feature yet (a one-token prompt) or no room left: decode plainly.
        if length < 2 or self.known < length - 1 or depth_limit < 1 or (self.cached >= length - 1 and self._predicted is None):
            return TokenTree([NO_PARENT], root, [False])
        device = committed.device
        head, top_k = self.head, self.top_k
        predicted = self._catch_up(committed)  # (1, C)

        # Depth 1: the root's children.
        logp = head.draft_logits(predicted).log_softmax(-1)[0]  # (Vd,)
        scores, rows = logp.topk(top_k)
        all_scores, all_rows = [scores], [rows]
        all_parents = [torch.full((top_k,), -1, dtype=torch.long, device=device)]  # -1: the root
        frontier = torch.arange(top_k, device=device)  # node ids (0-based, root excluded)
        frontier_features = predicted.expand(top_k, -1)  # (R, C): each node's input feature
        ancestors = torch.empty((top_k, 0), dtype=torch.long, device=device)  # cache slots of ancestors
        next_id, slot = top_k, length - 1
        base_mask = torch.arange(length - 1, device=device)[None] >= self.floor  # (1, L - 1): the committed pairs read
        for depth in range(1, depth_limit):
            count = frontier.shape[0]
            node_tokens = head.to_target_vocab(torch.cat(all_rows)[frontier])
            own_slots = torch.arange(slot, slot + count, device=device)
            ancestors = torch.cat([ancestors, own_slots[:, None]], dim=1)  # (R, depth)
            kv_len = slot + count
            mask = torch.zeros((count, kv_len), dtype=torch.bool, device=device)
            mask[:, : length - 1] = base_mask
            mask.scatter_(1, ancestors, True)
            positions = torch.full((1, count), length + depth - 1, dtype=torch.long, device=device)
            out = self._run(frontier_features[None], node_tokens[None], positions, slot, KVView(kv_len, mask[None, None]))
            slot += count
            child_logp = head.draft_logits(out[0]).log_softmax(-1)  # (R, Vd)
            child_scores, child_rows = child_logp.topk(top_k, dim=-1)  # (R, top_k)
            parent_scores = torch.cat(all_scores)[frontier]
            cumulative = (parent_scores[:, None] + child_scores).reshape(-1)
            all_scores.append(cumulative)
            all_rows.append(child_rows.reshape(-1))
            all_parents.append(frontier.repeat_interleave(top_k))
            child_ids = torch.arange(next_id, next_id + count * top_k, device=device)
            next_id += count * top_k
            # The next frontier: the best top_k of the new children.
            best = cumulative.topk(min(top_k, cumulative.shape[0])).indices
            frontier = child_ids[best]
            frontier_features = out[0].repeat_interleave(top_k, dim=0)[best]
            ancestors = ancestors.repeat_interleave(top_k, dim=0)[best]

        scores = torch.cat(all_scores)
        chosen = scores.topk(min(self.tree_size, scores.shape[0])).indices
        node_rows, parents_all = torch.cat(all_rows), torch.cat(all_parents)
        # The one host read of the drafting: which nodes, and every node's parent.
        host = torch.cat([chosen, parents_all]).tolist()
        chosen_ids, parent_of = host[: chosen.shape[0]], host[chosen.shape[0] :]
        keep = set(chosen_ids)
        for node in chosen_ids:  # close over ancestors (only equal scores can leave one out)
            parent = parent_of[node]
            while parent >= 0 and parent not in keep:
                keep.add(parent)
                parent = parent_of[parent]
        # Node ids grow with depth, so sorting puts every parent before its children.
        order = sorted(keep)
        tree_index = {node: i + 1 for i, node in enumerate(order)}
        parents = [NO_PARENT] + [tree_index.get(parent_of[node], 0) for node in order]
        order_tensor = host_to_device(order, torch.long, device)
        tokens = torch.cat([root, head.to_target_vocab(node_rows[order_tensor])])
        return TokenTree(parents, tokens, [False] * len(parents))
