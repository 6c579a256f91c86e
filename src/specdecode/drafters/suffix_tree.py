"""A depth-bounded suffix tree over token sequences with occurrence counts (suffix decoding).

What it stores. For a set of sequences, every run of up to ``max_depth`` tokens that starts
anywhere in a sequence is a path from the root, and the count along a path is the number of
(sequence, start) pairs whose run passes there. What followed a context, and how often, is
therefore read below the place the context leads to: SuffixDecoding's suffix trees (arXiv
2411.04975), which are bounded by a depth too.

Compact, so that repeated text (what suffix decoding is for) does not cost depth x length:

- a run only one occurrence passes through is a *tail*: a reference (sequence, position) into
  the stored tokens, standing for that sequence's next tokens down to the depth bound; a
  second occurrence entering it splits it;
- a node carries a *label* of one or more tokens with one count (path compression): a chain
  of single-child nodes with equal counts is one node. A suffix that walks along an existing
  path, as a growing sequence repeating earlier text does, extends its node's label instead of
  adding a node per token (the label is fused forward), so a repeat costs O(1) nodes per
  position plus its label tokens (4 bytes each), not O(max_depth) nodes.

Incremental. A growing sequence keeps its open suffixes (those shorter than ``max_depth``), each
ending at a node boundary or inside its own tail; appending a token extends each by one:
O(max_depth) dictionary operations per token. A tree built token by token has the same runs and
counts as one built from whole sequences (tested against a brute-force count of every run).
Removing a sequence walks each of its runs once, lowering counts and freeing what no occurrence
passes through any more; splits are not undone.

Matching finds the longest suffix of a context that occurred with a continuation; drafting
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
# Cursor kinds (the third field of a cursor): at the end of a node's label, or inside it; any
# value >= 0 is a sequence id: inside that sequence's tail.
_AT_END = -1
_IN_LABEL = -2

# A cursor is a place in the tree: (node, depth, kind, pos), depth counting the tokens read.
# (node, depth, _AT_END, 0): at the end of node's label. (node, depth, _IN_LABEL, j): inside
# node's label, next token extra[node][j]. (node, depth, seq, pos): inside the tail of sequence
# ``seq`` below ``node``, next token tokens[seq][pos].
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
        # Per node (the root is node 0): count, children (first token -> node id >= 0 or tail < 0),
        # parent, and the label's tokens after its first (None: a one-token label; the first
        # token is the node's key in its parent's children).
        self._count: list[int] = [0]
        self._kids: list[dict[int, int] | None] = [None]
        self._parent: list[int] = [-1]
        self._extra: list[array | None] = [None]
        self._free: list[int] = []
        self._tokens: dict[int, array] = {}
        # The open suffixes of growing sequences, by start position: those ending at a node, as
        # [start, node, depth], extended token by token; and those inside their own tail, as
        # start -> [node, depth, tail position], which grow for free (a tail stands for the
        # sequence's next tokens) until another occurrence splits the tail.
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

    def _new_node(self, count: int, parent: int) -> int:
        if self._free:
            node = self._free.pop()
            self._count[node], self._parent[node] = count, parent
            return node
        self._count.append(count)
        self._kids.append(None)
        self._parent.append(parent)
        self._extra.append(None)
        return len(self._count) - 1

    def _label_len(self, node: int) -> int:
        extra = self._extra[node]
        return 1 if extra is None else 1 + len(extra)

    def _append(self, seq_id: int, token: int) -> None:
        seq = self._tokens[seq_id]
        n = len(seq)
        seq.append(token)
        self.num_tokens += 1
        depth_bound = self.max_depth
        at_node = self._at_node[seq_id]
        at_node.append([n, ROOT, 0])
        in_tail = self._in_tail[seq_id]
        # Work below may move suffixes of this sequence to a node: they go to the new list and
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
                continue
            # This suffix ends at ``node`` and goes on to ``ref``. When every other occurrence
            # through ``node`` goes on to ``ref`` too (a chain), fuse instead of adding a node.
            chain = node != ROOT and len(kids) == 1
            if ref < 0:
                if chain and self._count[node] == 2:
                    self._fuse_tail(node, depth, token, ref)
                    extended.append([start, node, depth + 1])
                else:
                    extended.append([start, self._split_tail(node, depth, token, ref), depth + 1])
            elif chain and self._count[node] == self._count[ref] + 1:
                extended.append(self._fuse_node(seq, start, node, depth, ref))
            else:
                self._count[ref] += 1
                if self._extra[ref] is not None:
                    ref = self._split_label(node, token, ref)
                extended.append([start, ref, depth + 1])
        if len(in_tail) > 2 * depth_bound:  # forget suffixes that filled the depth bound
            for start in [s for s in in_tail if s + depth_bound <= n]:
                del in_tail[start]

    def _move_tail(self, node: int, depth: int, ref: int) -> None:
        """The tail ``ref`` lost its first token into ``node`` (now ending at ``depth``): hang
        what is left of it below ``node`` and tell its owner, if still growing, where it is."""
        other, pos = _untail(ref)
        other_seq = self._tokens[other]
        if depth + 1 <= self.max_depth and pos + 1 < len(other_seq):
            self._kids[node] = {other_seq[pos + 1]: _tail(other, pos + 1)}
        else:
            self._kids[node] = None
        owners = self._in_tail.get(other)
        start = pos - (depth - 1)  # the suffix that owned the tail
        if owners is not None and owners.pop(start, None) is not None and len(other_seq) < start + self.max_depth:
            if pos + 1 < len(other_seq):
                owners[start] = [node, depth, pos + 1]
            else:  # its last token was the one taken: it now ends at ``node``
                self._at_node[other].append([start, node, depth])

    def _split_tail(self, node: int, depth: int, token: int, ref: int) -> int:
        """A second occurrence enters the tail ``ref`` below ``node``: its first token becomes
        a node with count 2; the new node's id."""
        child = self._new_node(2, node)
        self._kids[node][token] = child  # type: ignore[index]
        self._move_tail(child, depth + 1, ref)
        return child

    def _fuse_tail(self, node: int, depth: int, token: int, ref: int) -> None:
        """``node`` holds this suffix and the tail ``ref`` only: take the tail's first token into
        its label rather than adding a node."""
        extra = self._extra[node]
        if extra is None:
            extra = self._extra[node] = array("i")
        extra.append(token)
        self._move_tail(node, depth + 1, ref)

    def _fuse_node(self, seq: array, start: int, node: int, depth: int, child: int) -> list[int]:
        """Every occurrence through ``node`` but this suffix (which ends there) goes on to
        ``child``: with this suffix ``child``'s first token has ``node``'s count, so it joins
        ``node``'s label. The suffix's new entry."""
        child_extra = self._extra[child]
        token = next(iter(self._kids[node]))  # type: ignore[arg-type]
        if child_extra is None:
            # All of the child joins: it takes the node's place (open suffixes ending at the
            # child, or in tails below it, keep pointing at it); only this suffix ended at node.
            parent = self._parent[node]
            first = seq[start + depth - self._label_len(node)]  # the node's key: its label's first token
            node_extra = self._extra[node]
            label = array("i") if node_extra is None else node_extra
            label.append(token)
            self._kids[parent][first] = child  # type: ignore[index]
            self._extra[child] = label
            self._count[child] = self._count[node]
            self._parent[child] = parent
            self._release(node)
            return [start, child, depth + 1]
        node_extra = self._extra[node]
        if node_extra is None:
            node_extra = self._extra[node] = array("i")
        node_extra.append(token)
        self._kids[node] = {child_extra[0]: child}
        self._extra[child] = child_extra[1:] if len(child_extra) > 1 else None
        return [start, node, depth + 1]

    def _split_label(self, parent: int, token: int, node: int) -> int:
        """Split ``node``'s first token off into a new node (which already counts one more
        occurrence than the rest of the label): the new node's id. ``node`` keeps the rest of
        its label, its depth and its children, so whatever points at it stays right."""
        extra = self._extra[node]
        assert extra is not None
        head = self._new_node(self._count[node], parent)
        self._count[node] -= 1
        self._kids[parent][token] = head  # type: ignore[index]
        self._kids[head] = {extra[0]: node}
        self._extra[node] = extra[1:] if len(extra) > 1 else None
        self._parent[node] = head
        return head

    def _release(self, node: int) -> None:
        self._kids[node] = None
        self._extra[node] = None
        self._count[node] = 0
        self._parent[node] = -1
        self._free.append(node)

    def remove(self, seq_id: int) -> None:
        """Remove a sequence and every occurrence it contributed."""
        seq = self._tokens.pop(seq_id)
        self.close(seq_id)
        self.num_tokens -= len(seq)
        length = len(seq)
        for start in range(length):
            node, pos, end = ROOT, start, min(length, start + self.max_depth)
            while pos < end:
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
                node, pos = ref, pos + self._label_len(ref)  # runs end at node boundaries
            if self._kids[node] == {}:
                self._kids[node] = None

    def _free_subtree(self, top: int) -> None:
        stack = [top]
        while stack:
            node = stack.pop()
            kids = self._kids[node]
            if kids:
                stack.extend(ref for ref in kids.values() if ref >= 0)
            self._release(node)

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
                extra = self._extra[node]
                if extra is not None:
                    for j, token in enumerate(extra):
                        if i == end:
                            return node, depth, _IN_LABEL, j
                        if token != context[i]:
                            return None
                        i, depth = i + 1, depth + 1
                continue
            seq_id, pos = _untail(ref)
            seq = self._tokens[seq_id]
            limit = min(len(seq), pos + self.max_depth - depth)
            while i < end:
                if pos >= limit or seq[pos] != context[i]:
                    return None
                i, pos, depth = i + 1, pos + 1, depth + 1
            return node, depth, seq_id, pos
        return node, depth, _AT_END, 0

    def _children(self, cursor: Cursor) -> list[tuple[int, int, Cursor]]:
        """(token, count, place after it) for each continuation seen at ``cursor``."""
        node, depth, kind, pos = cursor
        if depth >= self.max_depth:
            return []
        if kind == _AT_END:
            kids = self._kids[node]
            if not kids:
                return []
            out = []
            for token, ref in kids.items():
                if ref >= 0:
                    after = (ref, depth + 1, _AT_END if self._extra[ref] is None else _IN_LABEL, 0)
                    out.append((token, self._count[ref], after))
                else:
                    tail_seq, tail_pos = _untail(ref)
                    out.append((token, 1, (node, depth + 1, tail_seq, tail_pos + 1)))
            return out
        if kind == _IN_LABEL:
            extra = self._extra[node]
            assert extra is not None
            after = (node, depth + 1, _IN_LABEL, pos + 1) if pos + 1 < len(extra) else (node, depth + 1, _AT_END, 0)
            return [(extra[pos], self._count[node], after)]
        seq = self._tokens[kind]
        return [(seq[pos], 1, (node, depth + 1, kind, pos + 1))] if pos < len(seq) else []

    def match(self, context: Sequence[int], max_len: int) -> tuple[Cursor, int] | None:
        """The longest suffix of ``context`` (at most ``max_len`` tokens) that occurred with at
        least one token after it: (its place, its length), or None.

        Having occurred with a continuation is monotone in the suffix's length: every occurrence
        of a suffix holds the next shorter suffix, followed by the same token, and a stored run
        holds its own tails (within the depth bound). So the longest is binary-searched, after
        trying the whole tail first (inside a copy, the common case, that one walk settles it):
        log(n) walks rather than one per length, every step of every request."""
        tail = list(context[-max_len:]) if max_len > 0 else []
        if not tail:
            return None
        cursor = self._walk(tail, 0)
        if cursor is not None and self._children(cursor):
            return cursor, len(tail)
        low, high, found = 1, len(tail) - 1, None
        while low <= high:
            length = (low + high) // 2
            cursor = self._walk(tail, len(tail) - length)
            if cursor is not None and self._children(cursor):
                found, low = (cursor, length), length + 1
            else:
                high = length - 1
        return found

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
        width = max_nodes if branching is None else branching

        def push(place: Cursor, prob: float, parent: int, level: int) -> None:
            nonlocal order
            children = self._children(place)
            total = sum(count for _, count, _ in children)
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
            if place[2] >= 0:
                draft.sequences.add(place[2])
            if level < max_depth:
                push(place, -neg_prob, len(draft.tokens) - 1, level + 1)
        return draft

    # -- inspection ----------------------------------------------------------------------------
    def counts(self) -> dict[tuple[int, ...], int]:
        """Every stored run and its count (tails and labels expanded): the tree's content,
        independent of how it was built. For tests; walks the whole tree."""
        out: dict[tuple[int, ...], int] = {}
        stack: list[tuple[Cursor, tuple[int, ...]]] = [((ROOT, 0, _AT_END, 0), ())]
        while stack:
            place, path = stack.pop()
            for token, count, after in self._children(place):
                run = path + (token,)
                out[run] = out.get(run, 0) + count
                stack.append((after, run))
        return out

    def memory_bytes(self) -> int:
        """Bytes the tree holds on the Python heap (its lists, dictionaries, labels, int objects
        and token arrays), counted by walking it; close to what tracemalloc measures (tested)."""
        lists = (self._count, self._kids, self._parent, self._extra, self._free)
        size = sum(sys.getsizeof(values) for values in lists)
        size += sum(sys.getsizeof(c) for c in self._count if not -5 <= c <= 256)
        size += sum(sys.getsizeof(p) for p in self._parent if not -5 <= p <= 256)
        size += sum(sys.getsizeof(label) for label in self._extra if label is not None)
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
