"""The drafter interface: propose tokens, hear how many were accepted.

A drafter never touches the engine or the target's cache. Each step the engine hands it the
committed sequence and asks for up to ``num_tokens`` proposals; after verification it calls
``on_verified`` with the number the target accepted, so a drafter with state (its own KV
cache, acceptance statistics) can roll back or adapt.

A drafter that works on the host (prompt lookup) may also define ``on_committed(tokens)``: the
engine then hands it the committed tokens as host ints (the prompt at the start, each step's
emitted tokens after it), so it need not read the device sequence, a sync on GPUs.

The engine feeds a prompt's tail (what the prefix cache does not hold) in the first verify pass
with the first drafts, so the first proposal comes before the target has read the prompt. A
drafter that reads the target's cache (layer skip) sets ``reads_target_cache = True``: the
engine then prefills the prompt in a pass of its own first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdecode.backends.base import SequenceModel
from specdecode.core.sampling import LogitsProcessor
from specdecode.core.tree import TokenTree


@dataclass(slots=True)
class DraftProposal:
    tokens: torch.Tensor  # (B, k) long; k may be smaller than asked for, even 0
    probs: torch.Tensor | None  # (B, k, V_target) float: the q each token was sampled from; None = deterministic
    # Forward passes of a draft model spent on this proposal (0 for model-free drafters): the
    # benchmark's bandwidth ceiling counts the weight bytes they read.
    forward_passes: int = 0
    # The grammar's forced tokens (engine/grammar.py), drafted in place of the drafter's: the
    # drafter and the acceptance statistics that steer it hear nothing of this step.
    forced: bool = False
    # A batch row's token tree (engine/batch.py): ``tokens`` are then its nodes after the root
    # (tree.tokens[1:], so the row's input is built as a chain's is) and ``probs`` is None.
    tree: TokenTree | None = None

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[1]

    @property
    def depth(self) -> int:
        """The most drafts the row could accept: a chain's length, a tree's depth."""
        return self.tree.max_depth if self.tree is not None else self.num_tokens


class Drafter(Protocol):
    """What the engine needs from any way of guessing the target's next tokens."""

    def start(self, prompt_len: int, capacity: int, target: SequenceModel, shared_prefix: int = 0) -> None:
        """A new request begins; its committed sequence will never exceed ``capacity`` tokens.

        ``target`` is the target's sequence for this request, for a drafter that runs the
        target itself (layer skip, on the torch backend): it may write cache slots past the
        committed length, which the next verify pass overwrites, and must not commit.
        ``shared_prefix``: the prompt's first tokens equal to the previous request's committed
        tokens (the engine's prefix cache, ``engine/prefix.py``); a drafter with a KV cache of
        its own may keep that much of it instead of reading it again.
        """

    def propose(
        self,
        committed: torch.Tensor,  # (B, L) long: prompt plus accepted output so far
        num_tokens: int,
        processor: LogitsProcessor,
        generator: torch.Generator | None,
    ) -> DraftProposal:
        """Guess up to ``num_tokens`` next tokens (with their q when sampling)."""

    def on_verified(self, num_accepted: int) -> None:
        """The target accepted the first ``num_accepted`` tokens of the last proposal."""


class TreeDrafter(Protocol):
    """A drafter that proposes a token tree and reads the target's features (Medusa, EAGLE).

    Instead of hearing back an accepted count, it is shown the target's features (the final
    hidden states, ``ModelOutput.hidden``) of every committed position: the prompt's after
    prefill, then the accepted path's after each verify pass.
    """

    max_tree_nodes: int  # the most nodes (root included) a proposed tree can have
    last_forward_passes: int  # forward passes of draft heads the last proposal took

    def start(self, prompt_len: int, capacity: int, target: SequenceModel | None = None, shared_prefix: int = 0) -> None:
        """A new request begins (as ``Drafter.start``)."""

    def observe(self, features: torch.Tensor, start: int) -> None:  # features: (1, T, C)
        """The target's features at positions start .. start + T - 1, now committed."""

    def propose_tree(
        self,
        committed: torch.Tensor,  # (1, L) long
        max_depth: int,
        processor: LogitsProcessor,
        generator: torch.Generator | None,
    ) -> TokenTree:
        """A tree rooted at the last committed token (node 0), at most ``max_depth`` deep; a
        root-only tree decodes plainly."""


class HeadsDrafter(TreeDrafter, Protocol):
    """A tree drafter over trained heads (Medusa, EAGLE) that the batch engine gives each row
    a copy of: the heads are shared, what it keeps of a sequence (features, its own cache) is not."""

    def fresh(self) -> HeadsDrafter:
        """Another drafter over the same heads, for another sequence."""
