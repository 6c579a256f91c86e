"""What a step may commit: at most the tokens the request has left, up to an end-of-generation
token. Shared by the single-sequence and the batch engine, so both stop at the same token."""

from __future__ import annotations

from collections.abc import Collection


def cut_at_stop(
    emitted: list[int], remaining: int, eos_token_ids: Collection[int], ignore_eos: bool
) -> tuple[list[int], str]:
    """The tokens to commit out of a step's ``emitted`` ones, and why the request stops after
    them: "eos" (an end-of-generation token, kept in the output as Hugging Face does), "length"
    (``remaining`` reached) or "" (it goes on)."""
    tokens = emitted[:remaining]
    if not ignore_eos:
        for index, token in enumerate(tokens):
            if token in eos_token_ids:
                return tokens[: index + 1], "eos"
    return tokens, "length" if len(tokens) >= remaining else ""
