"""EAGLE drafting for many sequences at once: one head pass per tree level over every row.

What the head keeps of one sequence (``HeadState``: the target's features by position, the
head's own one-layer KV over the pairs it read) stays the row's own, so a row that ends, fails
or is preempted leaves the others as they were. What is shared is the pass: ``BatchEagle``
drafts the trees of B rows with the passes of one row (a catch-up over each row's unread pairs,
padded to the longest, then one pass per tree level over every row's frontier), and reads the
host once for all of them. The algorithm is EAGLE-2's, row by row (drafters/eagle.py); one
row alone (the single-request engine) runs it on its own cache, with no copy.

The head's KV is a static cache addressed by slot (``kv/static.py``), one tensor row per
sequence: B rows' caches cannot be read by one attention call where they are. So a step of
B > 1 rows copies each row's read pairs into a padded cache of its own (B rows, as wide as the
longest row needs), runs every pass on it, and copies back the pairs its catch-up read: one
more read of the rows' head KV per step, against B - 1 fewer head passes per level. Expansion
rows are scratch (the next catch-up overwrites them in place), so they are never copied back.
Padding in the catch-up (a row with fewer unread pairs than the longest) writes one scratch
slot past every slot a query reads, so it can never be seen.

A row's state moves only after its catch-up pass has run and been copied back, so drafting a
step again (the batch engine reruns a failed step) finds the pairs read and redoes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from specdecode.core.device import host_to_device
from specdecode.core.tree import NO_PARENT, TokenTree
from specdecode.kv.static import KVCache, KVView
from specdecode.models.heads import EagleHead

SCRATCH_SLOTS = 1  # past a padded cache's widest read: where catch-up padding writes


@dataclass(slots=True)
class HeadState:
    """What the EAGLE head keeps of one sequence."""

    cache: KVCache | None = None  # (1 row) slot p: pair p; slots past the pairs read: a step's expansion rows
    features: torch.Tensor | None = None  # (capacity, C) the target's features by position
    known: int = 0  # features known for positions [floor, known)
    cached: int = 0  # pairs read into the head's cache: [floor, cached)
    # The first position whose feature was observed: 0, unless the sequence's first positions
    # came from a prefix cache or another sample's prompt (the batch engine), whose features
    # the target never computed for it. The head then attends to the pairs from here on only:
    # drafts read less context; verification, and so the output, is unchanged.
    floor: int = 0
    predicted: torch.Tensor | None = None  # (1, C) the last catch-up's predicted f_{cached}

    def start(self, head: EagleHead, capacity: int, expansion_slots: int) -> None:
        """A new sequence of at most ``capacity`` tokens; ``expansion_slots``: a step's tree rows."""
        cfg = head.config
        dtype, device = head.fc.weight.dtype, head.fc.weight.device
        slots = capacity + expansion_slots
        if self.cache is None or self.cache.capacity < slots:
            self.cache = KVCache(1, 1, cfg.num_kv_heads, cfg.head_dim, slots, dtype, device)
        self.cache.reset()
        if self.features is None or self.features.shape[0] < capacity:
            self.features = torch.empty((capacity, cfg.hidden_size), dtype=dtype, device=device)
        self.known = self.cached = self.floor = 0
        self.predicted = None

    def observe(self, features: torch.Tensor, start: int) -> None:  # features: (1, T, C)
        assert self.features is not None, "start() comes first"
        if start > self.known:  # positions [known, start) were never computed for this sequence
            self.floor = self.cached = start
            self.predicted = None
        self.features[start : start + features.shape[1]] = features[0]
        self.known = start + features.shape[1]


@dataclass(slots=True)
class EagleRow:
    """One sequence's request for a tree this step."""

    state: HeadState
    committed: torch.Tensor  # (L,) long, on the device: the committed tokens
    max_depth: int  # the deepest the tree may go (the row's k)

    @property
    def length(self) -> int:
        return self.committed.shape[0]


@dataclass(slots=True, frozen=True)
class BatchEagle:
    """The head and the tree's shape, shared by every row drafted together (equal for the
    drafters ``EagleDrafter.fresh`` makes: modules compare by identity)."""

    head: EagleHead
    embed_tokens: nn.Embedding  # the target's embedding (shared, not copied)
    tree_size: int
    depth: int
    top_k: int

    def depth_limit(self, row: EagleRow) -> int:
        """Tree levels the row drafts: 0 where it decodes plainly."""
        state = row.state
        # No feature yet (a one-token prompt), a read pair with no prediction (a fork observed
        # past its head's pairs), or no room left: decode plainly.
        if row.length < 2 or state.known < row.length - 1 or (state.cached >= row.length - 1 and state.predicted is None):
            return 0
        # A tree of n nodes is at most n deep: deeper expansions could never be kept.
        return max(0, min(self.depth, row.max_depth, self.tree_size))

    def propose(self, rows: Sequence[EagleRow]) -> tuple[list[TokenTree], int]:
        """A tree per row, rooted at its last committed token (a root-only tree decodes plainly),
        and the head passes run for all of them together."""
        trees = [TokenTree([NO_PARENT], row.committed[-1:], [False]) for row in rows]
        limits = [self.depth_limit(row) for row in rows]
        drafting = [i for i, limit in enumerate(limits) if limit > 0]
        if not drafting:
            return trees, 0
        batch = [rows[i] for i in drafting]
        depths = [limits[i] for i in drafting]
        levels = max(depths)
        # One row runs on its own cache; several on a padded copy (module docstring).
        cache = batch[0].state.cache if len(batch) == 1 else self._gather(batch, levels)
        assert cache is not None
        passes = self._catch_up(batch, cache)
        predicted = torch.cat([row.state.predicted for row in batch])  # type: ignore[misc]  # (B, C)
        scores, node_rows, parents = self._expand(batch, cache, predicted, levels)
        passes += levels - 1
        for i, tree in zip(drafting, self._select(batch, depths, scores, node_rows, parents), strict=True):
            trees[i] = tree
        return trees, passes

    def _gather(self, rows: Sequence[EagleRow], levels: int) -> KVCache:
        """A padded cache of the rows' read pairs, wide enough for the step's expansion rows and
        the catch-up's scratch slot."""
        cfg = self.head.config
        width = max(row.length - 1 for row in rows) + (levels - 1) * self.top_k + SCRATCH_SLOTS
        # Zeroed (KVCache's own allocation): a masked slot still enters attention's weighted sum
        # with weight 0, and 0 * NaN from uninitialised memory would poison it.
        weight = self.head.fc.weight
        padded = KVCache(1, len(rows), cfg.num_kv_heads, cfg.head_dim, width, weight.dtype, weight.device)
        for b, row in enumerate(rows):
            own, read = row.state.cache, row.state.cached
            assert own is not None
            padded.keys[0][b, :, :read] = own.keys[0][0, :, :read]
            padded.values[0][b, :, :read] = own.values[0][0, :, :read]
        return padded

    def _run(
        self,
        features: torch.Tensor,  # (B, T, C)
        tokens: torch.Tensor,  # (B, T) long
        positions: torch.Tensor,  # (B, T) long: rotary positions
        slots: torch.Tensor,  # (B, T) long: cache slots written
        cache: KVCache,
        view: KVView,
        contiguous_start: int | None,
    ) -> torch.Tensor:  # (B, T, C) predicted next features
        return self.head(features, self.embed_tokens(tokens), positions, cache, view,
                         contiguous_start=contiguous_start, slots=slots)

    def _catch_up(self, rows: Sequence[EagleRow], cache: KVCache) -> int:
        """Feed every row the pairs it has not read, up to p = L - 2, in one padded pass; each
        row's state then holds its predicted f_{L-1}. The passes run: 0 or 1."""
        firsts = [row.state.cached for row in rows]
        counts = [max(0, row.length - 1 - first) for row, first in zip(rows, firsts, strict=True)]
        width = max(counts)
        if width == 0:  # read already: the same step drafted again (the batch engine reruns a failed step)
            return 0
        device = rows[0].committed.device
        kv_len = max(row.length - 1 for row in rows)
        scratch = cache.capacity - SCRATCH_SLOTS
        # Query j of row b reads pair first_b + j; a padded query repeats the row's last pair (a
        # row with nothing unread: its last read pair) so its mask is never empty, and writes
        # the scratch slot.
        pairs = [[first + min(j, count - 1) if count else row.length - 2 for j in range(width)]
                 for row, first, count in zip(rows, firsts, counts, strict=True)]
        slots = [[first + j if j < count else scratch for j in range(width)]
                 for first, count in zip(firsts, counts, strict=True)]
        pair = host_to_device(pairs, torch.long, device)  # (B, W)
        slot = host_to_device(slots, torch.long, device)  # (B, W)
        positions = pair + 1  # pair p sits at position p + 1
        if len(rows) == 1:  # views, no copy
            first, row = firsts[0], rows[0]
            assert row.state.features is not None
            features = row.state.features[first : row.length - 1][None]
            tokens = row.committed[first + 1 : row.length][None]
        else:
            features = torch.stack([row.state.features[p] for row, p in zip(rows, pair, strict=True)])  # type: ignore[index]
            tokens = torch.stack([row.committed[p] for row, p in zip(rows, positions, strict=True)])
        floors = [row.state.floor for row in rows]
        if len(rows) == 1 and width == 1 and floors[0] == 0:
            mask = None  # one query that sees every read pair
        else:
            # Pair p sees pairs floor .. p.
            keys = torch.arange(kv_len, device=device)
            floor = host_to_device(floors, torch.long, device)
            mask = ((keys[None, None] <= pair[:, :, None]) & (keys[None, None] >= floor[:, None, None]))[:, None]
        contiguous = firsts[0] if len(rows) == 1 else None
        out = self._run(features, tokens, positions, slot, cache, KVView(kv_len, mask), contiguous)  # (B, W, C)
        for b, (row, first, count) in enumerate(zip(rows, firsts, counts, strict=True)):
            if count == 0:
                continue
            own, end = row.state.cache, row.length - 1
            assert own is not None
            if own is not cache:  # the pairs read go back to the row's own cache
                own.keys[0][0, :, first:end] = cache.keys[0][b, :, first:end]
                own.values[0][0, :, first:end] = cache.values[0][b, :, first:end]
            own.commit(0, end)
            row.state.cached = end
            row.state.predicted = out[b, count - 1][None]
        return 1

    def _expand(
        self,
        rows: Sequence[EagleRow],
        cache: KVCache,
        predicted: torch.Tensor,  # (B, C) each row's predicted f_{L-1}
        levels: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """EAGLE-2's expansion for every row at once, ``levels`` deep: each node's cumulative
        log-probability, draft-vocabulary row and parent (-1: the root), (B, N) each, node ids
        growing with depth. Every row has the same number of nodes per level (``top_k`` at the
        first, ``top_k``² after), so the rows stay one rectangular batch."""
        head, top_k = self.head, self.top_k
        device, batch = predicted.device, predicted.shape[0]
        ends = [row.length - 1 for row in rows]  # each row's pairs read: slots [floor, L - 1)
        end = host_to_device(ends, torch.long, device)  # (B,)
        # Depth 1: the root's children.
        logp = head.draft_logits(predicted).log_softmax(-1)  # (B, Vd)
        scores, draft_rows = logp.topk(top_k, dim=-1)  # (B, top_k)
        all_scores, all_rows = [scores], [draft_rows]
        all_parents = [torch.full((batch, top_k), -1, dtype=torch.long, device=device)]  # -1: the root
        frontier = torch.arange(top_k, device=device).expand(batch, top_k)  # node ids (0-based, root excluded)
        frontier_features = predicted[:, None].expand(batch, top_k, -1)  # (B, R, C): each node's input feature
        ancestors = torch.empty((batch, top_k, 0), dtype=torch.long, device=device)  # cache slots of ancestors
        widest = max(ends)
        keys = torch.arange(widest, device=device)
        floor = host_to_device([row.state.floor for row in rows], torch.long, device)
        base_mask = (keys[None] >= floor[:, None]) & (keys[None] < end[:, None])  # (B, widest): the pairs read
        offsets = torch.arange(top_k, device=device)
        next_id = top_k
        for depth in range(1, levels):
            # A level's rows go to slots past each row's pairs, which the next catch-up overwrites.
            first_slot = (depth - 1) * top_k
            node_tokens = head.to_target_vocab(torch.cat(all_rows, dim=1).gather(1, frontier))  # (B, R)
            own_slots = (end + first_slot)[:, None] + offsets  # (B, R)
            ancestors = torch.cat([ancestors, own_slots[:, :, None]], dim=2)  # (B, R, depth)
            kv_len = widest + first_slot + top_k
            mask = torch.zeros((batch, top_k, kv_len), dtype=torch.bool, device=device)
            mask[:, :, :widest] = base_mask[:, None]
            mask.scatter_(2, ancestors, True)  # a row sees the pairs read and its own ancestors' rows
            positions = (end + depth)[:, None].expand(batch, top_k)  # a node at depth d sits at L - 1 + d
            contiguous = ends[0] + first_slot if batch == 1 else None
            out = self._run(frontier_features, node_tokens, positions, own_slots, cache,
                            KVView(kv_len, mask[:, None]), contiguous)  # (B, R, C)
            child_logp = head.draft_logits(out).log_softmax(-1)  # (B, R, Vd)
            child_scores, child_rows = child_logp.topk(top_k, dim=-1)  # (B, R, top_k)
            parent_scores = torch.cat(all_scores, dim=1).gather(1, frontier)  # (B, R)
            cumulative = (parent_scores[:, :, None] + child_scores).reshape(batch, -1)  # (B, R * top_k)
            all_scores.append(cumulative)
            all_rows.append(child_rows.reshape(batch, -1))
            all_parents.append(frontier.repeat_interleave(top_k, dim=1))
            # The next frontier: the best top_k of the new children (ids next_id + index).
            best = cumulative.topk(top_k, dim=1).indices  # (B, top_k)
            frontier = next_id + best
            next_id += top_k * top_k
            parent = best // top_k  # the frontier row each child came from
            frontier_features = out.gather(1, parent[:, :, None].expand(-1, -1, out.shape[2]))
            ancestors = ancestors.gather(1, parent[:, :, None].expand(-1, -1, ancestors.shape[2]))
        return torch.cat(all_scores, dim=1), torch.cat(all_rows, dim=1), torch.cat(all_parents, dim=1)

    def _select(
        self,
        rows: Sequence[EagleRow],
        depths: list[int],
        scores: torch.Tensor,  # (B, N) cumulative log-probabilities
        node_rows: torch.Tensor,  # (B, N) long draft-vocabulary rows
        parents: torch.Tensor,  # (B, N) long parent ids, -1: the root
    ) -> list[TokenTree]:
        """Each row's tree: its ``tree_size`` best-scoring nodes of its own levels, closed over
        ancestors (a parent always scores at least as high as its child; only ties can leave one
        out), with one host read for every row."""
        top_k, (batch, total) = self.top_k, scores.shape
        # Nodes of levels past a row's own depth (the batch expanded as deep as its deepest row) never count.
        valid = [top_k + (depth - 1) * top_k * top_k for depth in depths]
        if min(valid) < total:
            counts = host_to_device(valid, torch.long, scores.device)
            scores = scores.masked_fill(torch.arange(total, device=scores.device)[None] >= counts[:, None], -torch.inf)
        size = min(self.tree_size, total)
        chosen = scores.topk(size, dim=1).indices  # (B, size)
        # The one host read of the drafting: which nodes, and every node's parent, for every row.
        host = torch.cat([chosen.reshape(-1), parents.reshape(-1)]).tolist()
        orders, flat = [], []
        for b in range(batch):
            chosen_ids = [node for node in host[b * size : (b + 1) * size] if node < valid[b]]
            parent_of = host[batch * size + b * total : batch * size + (b + 1) * total]
            keep = set(chosen_ids)
            for node in chosen_ids:  # close over ancestors (only equal scores can leave one out)
                parent = parent_of[node]
                while parent >= 0 and parent not in keep:
                    keep.add(parent)
                    parent = parent_of[parent]
            # Node ids grow with depth, so sorting puts every parent before its children.
            order = sorted(keep)
            tree_index = {node: i + 1 for i, node in enumerate(order)}
            orders.append([NO_PARENT] + [tree_index.get(parent_of[node], 0) for node in order])
            flat += [b * total + node for node in order]
        tokens = self.head.to_target_vocab(node_rows.reshape(-1)[host_to_device(flat, torch.long, scores.device)])
        trees, start = [], 0
        for row, tree_parents in zip(rows, orders, strict=True):
            count = len(tree_parents) - 1
            tree_tokens = torch.cat([row.committed[-1:], tokens[start : start + count]])
            start += count
            trees.append(TokenTree(tree_parents, tree_tokens, [False] * len(tree_parents)))
        return trees
