"""The longest common prefix of two token sequences: how much of a cache the next prompt keeps
(the single-request prefix cache, engine/prefix.py; the llama.cpp batch's sequences; a draft
model's own cache)."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length
