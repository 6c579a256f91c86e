"""A depth-bounded suffix trie over token sequences with occurrence counts (suffix decoding).

What it stores. For a set of sequences, every run of up to ``max_depth`` tokens that starts
anywhere in a sequence is a path from the root, and a node's count is the number of
(sequence, start) pairs whose run passes through it. The children of the node reached by a
context, with their counts, are therefore the empirical distribution of what followed that
context: SuffixDecoding's suffix trees (arXiv 2411.04975), which are bounded by a depth too.

Compact. A path that only one occurrence runs through is not stored node by node: its first
token is a *tail*, a reference (sequence, position) into the stored tokens that stands for that
sequence's next tokens, down to the depth bound. A second occurrence entering a tail splits one
node off it (count 2) and the tail moves one token down. So the nodes are the repeated runs
plus one tail per position, not positions x depth.

Incremental. A sequence that is still growing keeps its open suffixes (those shorter than
``max_depth``); appending a token extends each by one, so a token costs O(max_depth) dictionary
operations, and a tree built token by token equals one built from the whole sequences (tested).
Removing a sequence walks each of its runs once, lowering counts and dropping nodes no
occurrence passes through any more. Nodes whose count falls to 1 stay nodes (only a fresh
insertion makes tails), so a tree that has seen removals may hold more nodes than a rebuilt one
of the same sequences; its counts, matches and drafts are the same.

Matching finds the longest suffix of a context that has occurred with a continuation; drafting
grows a token tree below it best first by path probability (the product of
count(child) / count(children) along the path). Host-only Python: no device tensors here.
"""

from __future__ import annotations

import heapq
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

ROOT = 0
_POS_BITS = 32  # a tail packs (sequence id, position) into one negative int
_POS_MASK = (1 << _POS_BITS) - 1
_INTERNAL = -1  # cursor/entry field "sequence" of a position at a node (not inside a tail)

# A cursor is a place in the tree: (node, depth, seq, pos). With seq == _INTERNAL it is node
# ``node`` at ``depth``; otherwise it is inside the tail of sequence ``seq``, whose next token is
# ``tokens[seq][pos]`` at depth + 1.
Cursor = tuple[int, int, int, int]


def _tail(seq_id: int, pos: int) -> int:
    return -1 - ((seq_id << _POS_BITS) | pos)


def _untail(ref: int) -> tuple[int, int]:
    packed = -1 - ref
    return packed >> _POS_BITS, packed & _POS_MASK


@dataclass(slots=True)
class Draft:
    """A token tree proposed below a match, nodes best first (a parent before its children).

    parents[i] is the index of node i's parent in these lists, or -1 for a node that follows the
    context directly; probs[i] is node i's path probability estimated from counts.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match_len: int = 0  # context tokens matched (0: no match, empty draft)
    sequences: set[int] = field(default_factory=set)  # sequence ids whose tails the draft read

    @property
    def score(self) -> float:
        """Expected accepted tokens if the probabilities are right: the sum of path probabilities."""
        return sum(self.probs)

    def __len__(self) -> int:
        return len(self.tokens)


class SuffixTree:
    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2 (a match and one token after it), got {max_depth}")
        self.max_depth = max_depth
        self._count: list[int] = [0]  # per node; the root's is unused
        self._kids: list[dict[int, int] | None] = [None]  # token -> node id (>= 0) or tail (< 0)
        self._free: list[int] = []
        self._tokens: dict[int, array] = {}
        # The suffixes (runs) of open sequences that may still grow, by start position: those
        # ending at a node, as [start, node, depth], extended token by token; and those inside
        # their own tail, as start -> [anchor node, anchor depth, tail position], which grow for
        # free (a tail stands for the sequence's next tokens) until a split moves them.
        self._at_node: dict[int, list[list[int]]] = {}
        self._in_tail: dict[int, dict[int, list[int]]] = {}
        self._next_seq = 0
        self.num_tokens = 0

    # -- sequences -----------------------------------------------------------------------------
    def add_sequence(self, tokens: Sequence[int] = ()) -> int:
        """Start a new sequence (open: it may grow with ``extend``); its id."""
        seq_id = self._next_seq
        self._next_seq += 1
        self._tokens[seq_id] = array("l")
        self._at_node[seq_id] = []
        self._in_tail[seq_id] = {}
        self.extend(seq_id, tokens)
        return seq_id

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Append tokens to an open sequence, inserting every suffix they extend."""
        if seq_id not in self._at_node:
            raise KeyError(f"sequence {seq_id} is not open (closed, removed or never added)")
        for token in tokens:
            self._append(seq_id, int(token))

    def close(self, seq_id: int) -> None:
        """No more tokens for this sequence: drop its open suffixes (the tree keeps it)."""
        self._at_node.pop(seq_id, None)
        self._in_tail.pop(seq_id, None)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._tokens

    def length(self, seq_id: int) -> int:
        return len(self._tokens[seq_id])

    @property
    def num_sequences(self) -> int:
        return len(self._tokens)

    @property
    def num_nodes(self) -> int:
        return len(self._count) - len(self._free) - 1  # the root not counted

    def _new_node(self, count: int) -> int:
        if self._free:
            node = self._free.pop()
            self._count[node] = count
            return node
        self._count.append(count)
        self._kids.append(None)
        return len(self._count) - 1

    def _append(self, seq_id: int, token: int) -> None:
        seq = self._tokens[seq_id]
        n = len(seq)
        seq.append(token)
        self.num_tokens += 1
        depth_bound = self.max_depth
        at_node = self._at_node[seq_id]
        at_node.append([n, ROOT, 0])
        in_tail = self._in_tail[seq_id]
        # Splits below may move suffixes of this sequence to a node: they go to the new list and
        # are extended from the next token on (they already hold this one).
        self._at_node[seq_id] = extended = []
        for start, node, depth in at_node:
            if n - start + 1 > depth_bound:
                continue  # this suffix already fills the depth bound
            kids = self._kids[node]
            if kids is None:
                kids = self._kids[node] = {}
            ref = kids.get(token)
            if ref is None:
                kids[token] = _tail(seq_id, n)
                in_tail[start] = [node, depth, n]
            elif ref >= 0:
                self._count[ref] += 1
                extended.append([start, ref, depth + 1])
            else:
                extended.append([start, self._split(node, depth, token, ref), depth + 1])
        if len(in_tail) > 2 * depth_bound:  # forget suffixes that filled the depth bound
            for start in [s for s in in_tail if s + depth_bound <= n]:
                del in_tail[start]

    def _split(self, node: int, depth: int, token: int, ref: int) -> int:
        """A second occurrence enters the tail ``ref`` below ``node``: split its first token off
        as a node with count 2 and move the tail one token down; the new node's id."""
        other, pos = _untail(ref)
        other_seq = self._tokens[other]
        child = self._new_node(2)
        if depth + 2 <= self.max_depth and pos + 1 < len(other_seq):
            self._kids[child] = {other_seq[pos + 1]: _tail(other, pos + 1)}
        self._kids[node][token] = child  # type: ignore[index]
        owners = self._in_tail.get(other)
        start = pos - depth  # the suffix that owned the tail, if it may still grow
        if owners is not None and owners.pop(start, None) is not None and len(other_seq) < start + self.max_depth:
            if pos + 1 < len(other_seq):
                owners[start] = [child, depth + 1, pos + 1]
            else:  # its last token was the one split off: it now ends at the new node
                self._at_node[other].append([start, child, depth + 1])
        return child

    def remove(self, seq_id: int) -> None:
        """Remove a sequence and every occurrence it contributed."""
        seq = self._tokens.pop(seq_id)
        self.close(seq_id)
        self.num_tokens -= len(seq)
        length = len(seq)
        for start in range(length):
            node = ROOT
            for pos in range(start, min(length, start + self.max_depth)):
                kids = self._kids[node]
                token = seq[pos]
                ref = kids[token]  # type: ignore[index]
                if ref < 0:  # the rest of this run is its own tail
                    del kids[token]  # type: ignore[union-attr]
                    break
                self._count[ref] -= 1
                if self._count[ref] == 0:  # this run was the last through it: free what is below
                    del kids[token]  # type: ignore[union-attr]
                    self._free_subtree(ref)
                    break
                node = ref
            if self._kids[node] == {}:
                self._kids[node] = None

    def _free_subtree(self, top: int) -> None:
        stack = [top]
        while stack:
            node = stack.pop()
            kids = self._kids[node]
            if kids:
                stack.extend(ref for ref in kids.values() if ref >= 0)
            self._kids[node] = None
            self._count[node] = 0
            self._free.append(node)

    # -- matching and drafting -----------------------------------------------------------------
    def _walk(self, context: Sequence[int], start: int) -> Cursor | None:
        """The place context[start:] leads to from the root, or None where it never occurred."""
        node, depth = ROOT, 0
        i, end = start, len(context)
        while i < end:
            kids = self._kids[node]
            ref = kids.get(context[i]) if kids is not None else None
            if ref is None:
                return None
            if ref >= 0:
                node, depth, i = ref, depth + 1, i + 1
                continue
            seq_id, pos = _untail(ref)
            seq = self._tokens[seq_id]
            limit = min(len(seq), pos + self.max_depth - depth)
            while i < end:
                if pos >= limit or seq[pos] != context[i]:
                    return None
                i, pos, depth = i + 1, pos + 1, depth + 1
            return node, depth, seq_id, pos
        return node, depth, _INTERNAL, 0

    def _children(self, cursor: Cursor) -> list[tuple[int, int, Cursor]]:
        """(token, count, place after it) for each continuation seen at ``cursor``."""
        node, depth, seq_id, pos = cursor
        if depth >= self.max_depth:
            return []
        if seq_id == _INTERNAL:
            kids = self._kids[node]
            if not kids:
                return []
            out = []
            for token, ref in kids.items():
                if ref >= 0:
                    out.append((token, self._count[ref], (ref, depth + 1, _INTERNAL, 0)))
                else:
                    tail_seq, tail_pos = _untail(ref)
                    out.append((token, 1, (node, depth + 1, tail_seq, tail_pos + 1)))
            return out
        seq = self._tokens[seq_id]
        return [(seq[pos], 1, (node, depth + 1, seq_id, pos + 1))] if pos < len(seq) else []

    def match(self, context: Sequence[int], max_len: int) -> tuple[Cursor, int] | None:
        """The longest suffix of ``context`` (at most ``max_len`` tokens) that occurred with at
        least one token after it: (its place, its length), or None."""
        tail = list(context[-max_len:]) if max_len > 0 else []
        for start in range(len(tail)):
            cursor = self._walk(tail, start)
            if cursor is not None and self._children(cursor):
                return cursor, len(tail) - start
        return None

    def draft(
        self,
        context: Sequence[int],
        *,
        max_nodes: int,
        max_depth: int,
        min_prob: float,
        max_match: int,
        branching: int | None = None,
        spec_factor: float | None = None,
    ) -> Draft:
        """A token tree after ``context``: below its longest match (at most ``max_match``
        tokens), the most probable continuations best first, each with path probability >=
        ``min_prob``, at most ``max_depth`` deep (and at most ``spec_factor`` x the match length)
        and ``max_nodes`` in all. ``branching=1`` drafts one chain (the most frequent
        continuation at each step). Paths end at the tree's depth bound: a long match leaves
        less room below it."""
        if max_nodes < 1 or max_depth < 1:
            return Draft()
        found = self.match(context, min(max_match, self.max_depth - 1))
        if found is None:
            return Draft()
        cursor, match_len = found
        if spec_factor is not None:
            max_depth = min(max_depth, max(1, int(spec_factor * match_len)))
        draft = Draft(match_len=match_len)
        order = 0  # heap tie-break: earlier pushes (higher count, then lower token id) first
        heap: list[tuple[float, int, int, int, int, Cursor]] = []

        def push(place: Cursor, prob: float, parent: int, level: int) -> None:
            nonlocal order
            children = self._children(place)
            total = sum(count for _, count, _ in children)
            width = max_nodes if branching is None else branching
            for token, count, after in heapq.nsmallest(width, children, key=lambda c: (-c[1], c[0])):
                child_prob = prob * count / total
                if child_prob >= min_prob:
                    heapq.heappush(heap, (-child_prob, order, parent, token, level, after))
                    order += 1

        push(cursor, 1.0, -1, 1)
        while heap and len(draft.tokens) < max_nodes:
            neg_prob, _, parent, token, level, place = heapq.heappop(heap)
            draft.tokens.append(token)
            draft.parents.append(parent)
            draft.probs.append(-neg_prob)
            if place[2] != _INTERNAL:
                draft.sequences.add(place[2])
            if level < max_depth:
                push(place, -neg_prob, len(draft.tokens) - 1, level + 1)
        return draft

    # -- inspection ----------------------------------------------------------------------------
    def counts(self) -> dict[tuple[int, ...], int]:
        """Every stored run and its count (tails expanded): the tree's content, independent of
        how it was built. For tests; walks the whole tree."""
        out: dict[tuple[int, ...], int] = {}
        stack: list[tuple[Cursor, tuple[int, ...]]] = [((ROOT, 0, _INTERNAL, 0), ())]
        while stack:
            place, path = stack.pop()
            for token, count, after in self._children(place):
                run = path + (token,)
                out[run] = out.get(run, 0) + count
                stack.append((after, run))
        return out

    def memory_bytes(self) -> int:
        """Bytes the tree holds on the Python heap (its lists, dictionaries, int objects and
        token arrays), counted by walking it; close to what tracemalloc measures (tested)."""
        size = sys.getsizeof(self._count) + sys.getsizeof(self._kids) + sys.getsizeof(self._free)
        size += sum(sys.getsizeof(c) for c in self._count if not -5 <= c <= 256)
        for kids in self._kids:
            if kids is None:
                continue
            size += sys.getsizeof(kids)
            size += sum(sys.getsizeof(t) for t in kids if not -5 <= t <= 256)
            size += sum(sys.getsizeof(r) for r in kids.values() if not -5 <= r <= 256)
        size += sys.getsizeof(self._tokens) + sum(sys.getsizeof(a) for a in self._tokens.values())
        for entries in self._at_node.values():
            size += sys.getsizeof(entries) + sum(sys.getsizeof(e) for e in entries)
        for owners in self._in_tail.values():
            size += sys.getsizeof(owners) + sum(sys.getsizeof(e) for e in owners.values())
        return size
