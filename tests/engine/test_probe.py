"""The public reads the audit uses instead of reaching into the engine (engine/probe.py):
SpecDecoder.target_logits and SpecDecoder.draft_probs. fp32 tiny models."""

from pathlib import Path

import pytest
import torch
from helpers import PROMPTS, decoder

from specdecode import SamplingParams
from specdecode.errors import InvalidRequestError


def test_target_logits_rank_plain_greedy_first_and_leave_decoding_as_it_was(
    tiny_qwen2_dir: Path, tiny_close_draft_dir: Path
) -> None:
    """Every row's argmax is plain greedy decoding's next token (fp32, so the multi-row pass
    does not move the argmax on these prompts), and a request after the reads decodes as one
    before them: the reads overwrite the target's cache, so the prefix cache must forget it."""
    dec = decoder(tiny_qwen2_dir, tiny_close_draft_dir)
    params = SamplingParams(max_new_tokens=12)
    for prompt in PROMPTS[:3]:
        ids = dec.encode(prompt)
        plain = dec.generate(ids, params, method="none").token_ids
        rows = dec.target_logits(ids, [plain[:i] for i in range(len(plain))])  # (len(plain), V)
        assert rows.shape == (len(plain), dec.target.config.vocab_size) and rows.dtype == torch.float32
        assert rows.argmax(dim=-1).tolist() == plain
        # Same prompt again: had the prefix cache kept its record, it would reuse K/V the reads replaced.
        assert dec.generate(ids, params, method="draft", k=3).token_ids == plain
    with pytest.raises(InvalidRequestError, match="prompt token"):
        dec.target_logits([], [()])


def test_draft_probs_is_the_drafters_next_token(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> None:
    dec = decoder(tiny_qwen2_dir, tiny_close_draft_dir)
    params = SamplingParams(temperature=1.0, top_k=5, seed=0)
    ids = dec.encode("a b c d a b c")
    # Prompt lookup copies what followed the last match ("d"): a one-hot on it.
    lookup = dec.draft_probs(ids, "ngram", params)
    assert lookup is not None and lookup.sum().item() == 1.0
    assert int(lookup.argmax()) == ids[ids.index(ids[-1]) + 1]
    # Nothing to copy: no proposal.
    assert dec.draft_probs(dec.encode("zq"), "ngram", params) is None
    # The draft model: a distribution over the top 5 of its own logits.
    q = dec.draft_probs(ids, "draft", params)
    assert q is not None and q.sum().item() == pytest.approx(1.0, abs=1e-5) and int((q > 0).sum()) == 5
    with pytest.raises(InvalidRequestError, match="no stateless chain drafter"):
        dec.draft_probs(ids, "auto", params)
