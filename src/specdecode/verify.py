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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
) -> VerifyResult:
    """Accept the longest prefix equal to the target's argmax, then emit the target's own token."""
    target_argmax = target_logits.argmax(dim=-1)  # (B, k + 1)
    k = draft_tokens.shape[1]
    accepted_len = _accepted_prefix_len(draft_tokens == target_argmax[:, :k])
    final = target_argmax.gather(1, accepted_len[:, None]).squeeze(1)
    return VerifyResult(accepted_len, _emit(draft_tokens, accepted_len, final))


def rejection_verify(
    draft_tokens: torch.Tensor,  # (B, k) long
    draft_probs: torch.Tensor | None,  # (B, k, V) float, or None for a deterministic (one-hot) draft
    target_probs: torch.Tensor,  # (B, k + 1, V) float
    generator: torch.Generator | None,
) -> VerifyResult:
    """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023)."""
    batch, k = draft_tokens.shape
    device = target_probs.device
    p_draft = target_probs[:, :k].gather(2, draft_tokens[..., None]).squeeze(2)  # (B, k)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(2, draft_tokens[..., None]).squeeze(2)
    uniform = torch.rand((batch, k), generator=generator, device=device, dtype=p_draft.dtype)
    # u < p/q written without the division, so q == 0 (impossible for a sampled token, but
    # cheap to guard) rejects rather than producing NaN.
    accepted_len = _accepted_prefix_len(uniform * q_draft < p_draft)

    rows = torch.arange(batch, device=device)
    p_row = target_probs[rows, accepted_len]  # (B, V): p_n
    # q_n, or zeros for the bonus row (n == k), which turns the residual into p_k itself.
    rejected = accepted_len < k
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
    # A zero residual only arises from rounding when p == q; fall back to p then.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_row)
    final = torch.multinomial(residual, 1, generator=generator).squeeze(1)
    return VerifyResult(accepted_len, _emit(draft_tokens, accepted_len, final))
