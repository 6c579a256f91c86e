"""The shape of a token tree as attention sees it: each node's depth and its ancestors.

A token tree (``core/tree.py``) is given by its parents list: ``parents[0] == -1`` (the root)
and ``0 <= parents[i] < i``. These host functions are what both the single-sequence tree pass
(``kv/static.tree_view``) and the paged batch pass (``kv/paged.PagedKVCache.view``) build their
masks and rotary positions from; they live below both so the cache need not import the engine.
"""

from __future__ import annotations

from collections.abc import Sequence


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth: the root 0, a child its parent's + 1."""
    depths = [0] * len(parents)
    for node in range(1, len(parents)):
        depths[node] = depths[parents[node]] + 1
    return depths


def ancestor_rows(parents: Sequence[int]) -> list[list[bool]]:
    """(N, N) on the host: [i][j] True when j == i or j is an ancestor of i (what node i attends
    to among the tree's nodes). A parent precedes its child, so row i is its parent's row plus i."""
    rows: list[list[bool]] = []
    for node, parent in enumerate(parents):
        row = list(rows[parent]) if parent >= 0 else [False] * len(parents)
        row[node] = True
        rows.append(row)
    return rows
