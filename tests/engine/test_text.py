"""Incremental detokenisation: the streamed text is the whole output's decode, however the tokens
arrive, for a byte-level BPE tokenizer (Qwen2's kind) and a SentencePiece-style one (Llama 2's
kind, which drops a leading space at the start of what it decodes)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from specdecode.engine.text import IncrementalDecoder

TEXT = ("The quick brown fox jumps over the lazy dog. Déjà vu, naïve café! 中文测试，表情😀👍🏽 Ω≈ç√ "
        "def f(x):\n    return x  # tabs\tand  double  spaces\n") * 3
STOP_TEXT = "alpha beta gamma STOP delta"


def metaspace_tokenizer():
    """A small SentencePiece-style BPE: spaces become "▁" (one prepended to the text), and
    decoding turns them back and drops the one at the start of what it decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", "</s>"])
    tok.train_from_iterator([TEXT, STOP_TEXT] * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


@pytest.fixture(params=["byte-level", "metaspace"])
def tokenizer(request: pytest.FixtureRequest, tiny_tokenizer_dir: Path):
    if request.param == "metaspace":
        return metaspace_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def test_streamed_text_is_the_whole_decode(tokenizer) -> None:
    rng = random.Random(0)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    special = tokenizer.eos_token_id
    for trial in range(60):
        if trial % 3 == 0:  # arbitrary ids: broken UTF-8 and special tokens mid-output included
            seq = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 50))]
        else:
            start = rng.randrange(len(ids) - 1)
            seq = ids[start : start + rng.randrange(1, 80)]
            if trial % 3 == 1:
                seq.insert(rng.randrange(len(seq) + 1), special)
        inc, streamed, i = IncrementalDecoder(tokenizer, ()), "", 0
        while i < len(seq):
            step = rng.randrange(1, 5)
            streamed += inc.add(seq[i : i + step])
            i += step
            whole = tokenizer.decode(seq[:i], skip_special_tokens=True)
            assert inc.text == whole, (trial, i)
            assert not streamed or whole.startswith(streamed)  # nothing shown is taken back
        streamed += inc.flush()
        assert streamed == tokenizer.decode(seq, skip_special_tokens=True), trial


def test_a_stop_string_across_windows_is_cut_and_never_half_shown(tokenizer) -> None:
    ids = tokenizer.encode(STOP_TEXT, add_special_tokens=False)
    inc, streamed = IncrementalDecoder(tokenizer, ("STOP",)), ""
    for token in ids:
        streamed += inc.add([token])
        assert "S" not in streamed.split("gamma")[-1]  # a possible stop string's start is held back
        if inc.stopped:
            break
    assert inc.stopped and (streamed + inc.flush()).rstrip() == "alpha beta gamma"


def test_of_several_stop_strings_in_one_step_the_first_in_the_text_ends_it(tokenizer) -> None:
    """A speculative step adds several tokens at once: when two stop strings arrive together, the
    text ends at the earlier one, whatever the order of the list, and ``stop_string`` names it."""
    ids = tokenizer.encode(STOP_TEXT, add_special_tokens=False)
    for stops in (("delta", "beta"), ("beta", "delta")):
        inc = IncrementalDecoder(tokenizer, stops)
        streamed = inc.add(ids) + inc.flush()
        assert inc.stopped and inc.stop_string == "beta" and streamed.rstrip() == "alpha"


def test_a_step_costs_the_same_late_in_a_long_output(tiny_tokenizer_dir: Path) -> None:
    """The decoder reads a window, not the output: count the tokens it decodes per step."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    decoded: list[int] = []
    real = tokenizer.decode

    class Counting:
        clean_up_tokenization_spaces = False

        def decode(self, ids, **kwargs):  # noqa: ANN001, ANN003, ANN201
            decoded.append(len(ids))
            return real(ids, **kwargs)

    ids = (tokenizer.encode(TEXT, add_special_tokens=False) * 20)[:2000]
    inc = IncrementalDecoder(Counting(), ())
    for token in ids:
        inc.add([token])
    assert inc.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert max(decoded[-200:]) <= 8  # the last steps decoded a few tokens each, not 2,000
