"""Verification of drafted tokens: pure functions, no model or cache in sight.

Terms (for one sequence with k drafted tokens d_1..d_k and target rows p_0..p_k, where row
p_i is the target's distribution for the token after d_1..d_i):

- accepted tokens: the longest prefix d_1..d_n that the acceptance rule keeps (0 <= n <= k);
- recovered token: when n < k, the token emitted in place of the rejected d_{n+1}, drawn
  from the residual norm(max(0, p_n - q_n)) (greedy: the target's argmax at row n);
- bonus token: when n == k, one more token drawn from the last row p_k for free.

Each step therefore emits n + 1 tokens. ``VerifyResult.tokens`` row b holds them in its first
``accepted_len[b] + 1`` entries; the rest is padding (-1).

With rejection sampling (accept d_i with probability min(1, p(d_i) / q(d_i))) the emitted
tokens are distributed exactly as if sampled from the target alone. A deterministic drafter
(n-gram lookup) has a one-hot q: acceptance becomes p(d_i), and the residual is p with d_i
removed, renormalised.

Trees (``TokenTree``, batch size 1): node i's target row is p_i, the distribution after the
path root..i. The accepted tokens are a root-to-node path, and the recovered/bonus token
follows its deepest node. ``rejection_tree_verify`` is recursive rejection sampling over each
node's children (SpecInfer), lossless like the chain rule; ``typical_tree_verify`` is Medusa's
typical acceptance, which is lossy and only for callers that opt in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdecode.core.categorical import argmax_last, sample_categorical
from specdecode.core.device import host_to_device
from specdecode.core.tree import ROOT, TokenTree

PAD_TOKEN = -1


@dataclass(slots=True)
class VerifyResult:
    accepted_len: torch.Tensor  # (B,) long: number of draft tokens accepted
    tokens: torch.Tensor  # (B, k + 1) long: accepted drafts, then the recovered/bonus token, then PAD


def _accepted_prefix_len(accepted: torch.Tensor) -> torch.Tensor:  # (B, k) bool -> (B,) long
    return accepted.long().cumprod(dim=1).sum(dim=1)


def _emit(draft_tokens: torch.Tensor, accepted_len: torch.Tensor, final_token: torch.Tensor) -> torch.Tensor:
    """Assemble (B, k+1) outputs: drafts[:n], final token at n, PAD after."""
    batch, k = draft_tokens.shape
    index = torch.arange(k + 1, device=draft_tokens.device)[None, :]
    padded = torch.cat([draft_tokens, draft_tokens.new_full((batch, 1), PAD_TOKEN)], dim=1)
    out = torch.where(index < accepted_len[:, None], padded, PAD_TOKEN)
    return out.scatter(1, accepted_len[:, None], final_token[:, None])


def greedy_verify(
    draft_tokens: torch.Tensor,  # (B, k) long
    target_logits: torch.Tensor,  # (B, k + 1, V)
    num_drafted: Sequence[int] | None = None,
) -> VerifyResult:
    """Accept the longest prefix equal to the target's argmax, then emit the target's own token.

    ``num_drafted`` (host ints, one per row) verifies a batch whose rows drafted different
    numbers of tokens, padded to k: row b's drafts past ``num_drafted[b]`` are never accepted,
    and its last token comes from its row ``num_drafted[b]`` at most.
    """
    target_argmax = argmax_last(target_logits)  # (B, k + 1)
    k = draft_tokens.shape[1]
    if k == 0:  # a plain step: the target's token, nothing to accept
        return VerifyResult(torch.zeros(target_argmax.shape[0], dtype=torch.long, device=target_argmax.device),
                            target_argmax)
    accepted_len = _accepted_prefix_len(draft_tokens == target_argmax[:, :k])
    if num_drafted is not None:
        accepted_len = torch.minimum(accepted_len, host_to_device(list(num_drafted), torch.long, draft_tokens.device))
    final = target_argmax.gather(1, accepted_len[:, None]).squeeze(1)
    return VerifyResult(accepted_len, _emit(draft_tokens, accepted_len, final))


def rejection_verify(
    draft_tokens: torch.Tensor,  # (B, k) long
    draft_probs: torch.Tensor | None,  # (B, k, V) float, or None for a deterministic (one-hot) draft
    target_probs: torch.Tensor,  # (B, k + 1, V) float
    generator: torch.Generator | None | Sequence[torch.Generator | None],
    num_drafted: Sequence[int] | None = None,
) -> VerifyResult:
    """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    ``generator`` may be one per row: each row then draws its random numbers from its own
    generator, in the shapes a one-row call would (so a seeded request samples the same tokens
    alone or in a batch). ``num_drafted`` (host ints) as in ``greedy_verify``; a deterministic
    row among probabilistic ones passes its one-hot q in ``draft_probs``.
    """
    batch, k = draft_tokens.shape
    device = target_probs.device
    if k == 0:  # plain sampling: the bonus row's residual is p itself (as below, without its cost)
        final = _sample_rows(target_probs[:, 0], generator)
        return VerifyResult(torch.zeros(batch, dtype=torch.long, device=device), final[:, None])
    per_row = generator is not None and not isinstance(generator, torch.Generator)
    p_draft = target_probs[:, :k].gather(2, draft_tokens[..., None]).squeeze(2)  # (B, k)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(2, draft_tokens[..., None]).squeeze(2)
    if per_row:
        generators = list(generator)  # type: ignore[arg-type]
        counts = list(num_drafted) if num_drafted is not None else [k] * batch
        uniform = torch.cat([
            torch.nn.functional.pad(torch.rand((1, n), generator=g, device=device, dtype=p_draft.dtype), (0, k - n))
            for g, n in zip(generators, counts, strict=True)
        ])
    else:
        uniform = torch.rand((batch, k), generator=generator, device=device, dtype=p_draft.dtype)
    # u < p/q written without the division, so q == 0 (impossible for a sampled token, but
    # cheap to guard) rejects rather than producing NaN.
    accepted_len = _accepted_prefix_len(uniform * q_draft < p_draft)
    drafted = torch.full((batch,), k, dtype=torch.long, device=device)
    if num_drafted is not None:
        drafted = host_to_device(list(num_drafted), torch.long, device)
        accepted_len = torch.minimum(accepted_len, drafted)

    rows = torch.arange(batch, device=device)
    p_row = target_probs[rows, accepted_len]  # (B, V): p_n
    # q_n, or zeros for the bonus row (n == the row's drafts), which turns the residual into p itself.
    rejected = accepted_len < drafted
    capped = accepted_len.clamp(max=max(k - 1, 0))
    if k == 0:
        q_row = torch.zeros_like(p_row)
    elif draft_probs is None:
        rejected_token = draft_tokens[rows, capped]
        q_row = torch.zeros_like(p_row).scatter(1, rejected_token[:, None], 1.0)
    else:
        q_row = draft_probs[rows, capped]
    q_row = q_row * rejected[:, None]
    residual = (p_row - q_row).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    # A zero residual only arises from rounding when p == q; fall back to p then. A row that
    # accepted all its drafts (or drafted none) draws from p itself, as the k == 0 path does: a
    # seeded row that drafts nothing samples the same token beside drafting rows as alone.
    residual = torch.where((mass > 0) & rejected[:, None], residual / mass.clamp_min(1e-30), p_row)
    return VerifyResult(accepted_len, _emit(draft_tokens, accepted_len, _sample_rows(residual, generator)))


def _sample_rows(
    probs: torch.Tensor,  # (B, V) float
    generator: torch.Generator | None | Sequence[torch.Generator | None],
) -> torch.Tensor:  # (B,) long
    """One token per row: each row from its own generator where one is given per row (the
    shapes a one-row call would draw), else all from ``generator``."""
    if generator is not None and not isinstance(generator, torch.Generator):
        return torch.cat([sample_categorical(probs[b : b + 1], g) for b, g in enumerate(generator)])
    return sample_categorical(probs, generator)


# --- token trees (batch size 1) ----------------------------------------------------------

DEFAULT_POSTERIOR_THRESHOLD = 0.09  # Medusa's defaults for typical acceptance
DEFAULT_POSTERIOR_ALPHA = 0.3


@dataclass(slots=True)
class TreeVerifyResult:
    path: list[int]  # accepted nodes, root first (host): [0, a1, ..., an]
    tokens: list[int]  # the n + 1 emitted tokens (host): tokens of a1..an, then the recovered/bonus token

    @property
    def accepted_len(self) -> int:
        return len(self.path) - 1


def _parent_rows(tree: TokenTree, device: torch.device) -> torch.Tensor:  # -> (N,) long
    """Row of each node's parent; the root points at itself (its row is never judged)."""
    return host_to_device([ROOT, *tree.parents[1:]], torch.long, device)


def _deepest_accepted(
    tree: TokenTree,
    acceptable: torch.Tensor,  # (N,) bool: node i passes its own test (the root's entry is ignored)
) -> torch.Tensor:  # () long
    """The deepest node whose whole path passes, ties to the lowest index; stays on the device."""
    size = tree.size
    device = acceptable.device
    index = torch.arange(size, device=device)
    # Not ``acceptable[ROOT] = True``: writing a Python scalar into a GPU tensor waits for the GPU.
    acceptable = acceptable | (index == ROOT)
    ancestors = tree.ancestor_mask(device)  # (N, N)
    path_ok = (acceptable[None, :] | ~ancestors).all(dim=1)
    depth = host_to_device(tree.depths, torch.long, device)
    # One integer key (deeper first, then lower index) so a single argmax decides both.
    key = torch.where(path_ok, depth * size + (size - 1 - index), -1)
    return key.argmax()


def _tree_result(tree: TokenTree, best: int, node_tokens: list[int], final: int) -> TreeVerifyResult:
    path = tree.path_to(best)
    return TreeVerifyResult(path, [node_tokens[node] for node in path[1:]] + [final])


def greedy_tree_verify(
    tree: TokenTree,
    target_logits: torch.Tensor,  # (N, V): row i = the target's logits after the path root..i
) -> TreeVerifyResult:
    """Accept the deepest path whose every token is the target's argmax at its parent.

    Node i matches when tokens[i] == argmax(target_logits[parents[i]]); among the nodes whose
    path matches throughout, the deepest wins (ties: the lowest index), and the target's
    argmax at that node follows it. One device-to-host transfer in all.
    """
    return greedy_tree_read(tree, greedy_tree_pick(tree, target_logits).tolist())


def greedy_tree_pick(
    tree: TokenTree,
    target_logits: torch.Tensor,  # (N, V)
) -> torch.Tensor:  # (N + 2,) long, on the device: the deepest matching node, the target's token after it, the node tokens
    """``greedy_tree_verify``'s device half: a batch reads many trees' picks in one transfer."""
    target_argmax = argmax_last(target_logits)  # (N,)
    matches = tree.tokens == target_argmax[_parent_rows(tree, target_logits.device)]
    best = _deepest_accepted(tree, matches).view(1)  # (1,): a 0-dim index would sync via .item()
    return torch.cat([best, target_argmax[best], tree.tokens])


def greedy_tree_read(tree: TokenTree, picked: list[int]) -> TreeVerifyResult:
    """``greedy_tree_verify``'s host half: ``greedy_tree_pick``'s values, read (or
    ``typical_tree_pick``'s: the same layout)."""
    return _tree_result(tree, picked[0], picked[2:], picked[1])


def _normalised(
    residual: torch.Tensor,  # (V,) float, non-negative
    fallback: torch.Tensor,  # (V,) float
) -> torch.Tensor:  # (V,)
    mass = residual.sum()
    # Zero mass only arises from rounding (an exact residual of a rejection is never empty);
    # fall back to the node's target row then, as rejection_verify does. No host sync.
    return torch.where(mass > 0, residual / mass.clamp_min(1e-30), fallback)


def rejection_tree_verify(
    tree: TokenTree,
    target_probs: torch.Tensor,  # (N, V) float: row i = the target's sampling distribution after root..i
    generator: torch.Generator | None,
) -> TreeVerifyResult:
    """Lossless recursive rejection sampling over a token tree (SpecInfer, Miao et al. 2024).

    At a node with residual r (initially its target row) the children are tried in node
    order. A sampled child c, drawn from q = draft_probs[node], is accepted with probability
    min(1, r(c) / q(c)), else r becomes norm(max(0, r - q)); a deterministic child (one-hot q)
    is accepted with probability r(c), else r loses c and is renormalised. Each try is one
    speculative-sampling step whose output is distributed as r, so by induction the emitted
    token after every accepted node follows its target row. An accepted child becomes the
    node; when every child is rejected (or at a leaf) the final token is drawn from r.

    Siblings sampled independently (with replacement) from the same q keep this exact.
    A sampled child with q(c) == 0 cannot come from q; the test ``u * q < r`` then accepts it
    exactly when r(c) > 0 (the limit of the ratio) without dividing by zero.

    Cost: one transfer up front (every child's first-try p and q and one uniform per node),
    then one host sync per child tried after a sibling's rejection and one for the final draw.
    """
    device = target_probs.device
    children = tree.children()
    parent_rows = _parent_rows(tree, device)
    # A child's first try sees its parent's untouched target row: gather all of those at once.
    first_p = target_probs[parent_rows, tree.tokens]  # (N,)
    first_q = first_p.new_ones(tree.size) if tree.draft_probs is None else tree.draft_probs[parent_rows, tree.tokens]
    uniforms = torch.rand(tree.size, generator=generator, device=device, dtype=first_p.dtype)
    first_p_host, first_q_host, uniforms_host = torch.stack([first_p, first_q.to(first_p.dtype), uniforms]).tolist()
    node_tokens = tree.tokens.tolist()

    node = ROOT
    residual: torch.Tensor | None = None  # None: the node's target row, untouched so far
    while True:
        for child in children[node]:
            token = node_tokens[child]
            r_child = first_p_host[child] if residual is None else residual[token].item()
            q_child = first_q_host[child] if tree.sampled[child] else 1.0  # deterministic: one-hot q
            if uniforms_host[child] * q_child < r_child:
                node, residual = child, None
                break
            base = target_probs[node] if residual is None else residual
            if tree.sampled[child]:
                rest = (base - tree.draft_probs[node]).clamp_min(0.0)
            else:
                rest = base.clone()
                rest[token] = 0.0
            residual = _normalised(rest, target_probs[node])
        else:  # every child rejected, or a leaf
            break
    final_row = target_probs[node] if residual is None else residual
    final = int(sample_categorical(final_row[None], generator).item())
    return _tree_result(tree, node, node_tokens, final)


def typical_tree_verify(
    tree: TokenTree,
    target_probs: torch.Tensor,  # (N, V) float: row i = the target's sampling distribution after root..i
    generator: torch.Generator | None,
    posterior_threshold: float = DEFAULT_POSTERIOR_THRESHOLD,
    posterior_alpha: float = DEFAULT_POSTERIOR_ALPHA,
) -> TreeVerifyResult:
    """Medusa's typical acceptance (Cai et al. 2024). LOSSY: the output is NOT distributed as
    the target's; use it only behind an explicit opt-in.

    Node i is acceptable when p_parent(token_i) > min(posterior_threshold,
    posterior_alpha * exp(-H(p_parent))), H the entropy: a flat target row accepts many
    plausible tokens, a peaked one only likely ones. The deepest node whose path is
    acceptable throughout wins (ties: the lowest index) and the final token is drawn from
    its target row. One device-to-host transfer in all.
    """
    picked = typical_tree_pick(tree, target_probs, generator, posterior_threshold, posterior_alpha)
    return greedy_tree_read(tree, picked.tolist())


def typical_tree_pick(
    tree: TokenTree,
    target_probs: torch.Tensor,  # (N, V) float
    generator: torch.Generator | None,
    posterior_threshold: float = DEFAULT_POSTERIOR_THRESHOLD,
    posterior_alpha: float = DEFAULT_POSTERIOR_ALPHA,
) -> torch.Tensor:  # (N + 2,) long, device: the deepest acceptable node, the token drawn after it, the node tokens
    """``typical_tree_verify``'s device half, laid out as ``greedy_tree_pick``'s so that a batch
    reads typical rows' picks with its greedy ones in its one transfer (``greedy_tree_read``)."""
    entropy = torch.special.entr(target_probs).sum(dim=-1)  # (N,) nats; entr(0) = 0
    cutoff = (posterior_alpha * torch.exp(-entropy)).clamp(max=posterior_threshold)  # (N,)
    parent_rows = _parent_rows(tree, target_probs.device)
    acceptable = target_probs[parent_rows, tree.tokens] > cutoff[parent_rows]
    best = _deepest_accepted(tree, acceptable).view(1)  # (1,): a 0-dim index would sync via .item()
    final = sample_categorical(target_probs[best], generator)  # (1,)
    return torch.cat([best, final, tree.tokens])
