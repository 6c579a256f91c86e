"""Log-probabilities of the generated tokens, read off the verify rows at no extra pass.

Row i of a verify pass is the target's distribution for the token at position i of what the
step emits (an accepted draft, or the recovered/bonus token at the last row), the same row
plain decoding computes for that position. So each emitted token's log-probability, and the
``n`` most likely tokens there, come from the rows the step already holds; they are packed
with the emitted tokens into the step's one host read.

Two modes (vLLM's ``logprobs_mode`` names): "raw", the model's own distribution (log-softmax of
its logits, before grammar, bias, penalties and temperature: the default, as vLLM's); and
"processed", the distribution the token was sampled from (greedy: the logits after grammar,
bias and penalties). A token a processed distribution excludes has log-probability -inf,
reported as ``MIN_LOGPROB`` (vLLM's -9999.0) so that JSON can carry it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MIN_LOGPROB = -9999.0


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the most likely (token, logprob) there, most likely first

    def to_dict(self) -> dict[str, object]:
        return {"token": self.token, "logprob": self.logprob, "top": [list(pair) for pair in self.top]}


def log_distribution(
    logits: torch.Tensor,  # (T, V) float: the rows as the mode wants them (raw or processed logits)
    probs: torch.Tensor | None = None,  # (T, V): the sampled-from distribution ("processed", sampling)
) -> torch.Tensor:  # (T, V) float32 log-probabilities
    if probs is not None:
        return probs.float().log()
    return logits.float().log_softmax(-1)


def pack(
    logp: torch.Tensor,  # (T, V) float32 log-probabilities, row i for emitted token i
    tokens: torch.Tensor,  # (T,) long: the emitted tokens (PAD = -1 past the last one)
    top: int,
) -> torch.Tensor:  # (T, 2 + 2 * top) float32: the token, its logprob, top logprobs, top ids
    """One step's logprobs as a float tensor to read with the step's tokens (ids < 2^24 are
    exact in float32, which every vocabulary is)."""
    chosen = logp.gather(1, tokens.clamp_min(0)[:, None])  # (T, 1)
    columns = [tokens.float()[:, None], chosen]
    if top > 0:
        best = logp.topk(min(top, logp.shape[-1]), dim=-1)
        columns += [best.values, best.indices.float()]
    return torch.cat(columns, dim=1).clamp_min(MIN_LOGPROB)


def unpack(rows: Sequence[Sequence[float]], count: int) -> list[TokenLogprob]:
    """The first ``count`` packed rows (host) as ``TokenLogprob``s."""
    out = []
    for row in rows[:count]:
        top = (len(row) - 2) // 2
        values, ids = row[2 : 2 + top], row[2 + top :]
        out.append(TokenLogprob(int(row[0]), float(row[1]), tuple((int(i), float(v)) for i, v in zip(ids, values))))
    return out
