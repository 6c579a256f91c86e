"""Compile time and per-token mask time of xgrammar and llguidance on the demo tokenizer (151k
tokens): why engine/grammar.py uses xgrammar (docs/structured.md).

    pip install llguidance && python benchmarks/grammar_engines.py
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from transformers import AutoTokenizer

from specdecode.models.gguf_tokenizer import cached_tokenizer_folder

VOCAB = 151936  # the demo target's logits width
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "urgent"]}},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "tags": ["urgent", "a"], "address": {"city": "London", "zip": "12345"}}


def timed(fn):
    started = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - started


def xgrammar_run(tokenizer, ids: list[int]) -> None:
    import xgrammar as xgr

    info, info_s = timed(lambda: xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB))
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    schema, schema_s = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))
    any_json, json_s = timed(compiler.compile_builtin_json_grammar)
    print(f"xgrammar: tokenizer info {info_s * 1e3:.0f} ms, schema compile {schema_s * 1e3:.0f} ms, "
          f"JSON grammar {json_s * 1e3:.0f} ms")
    for name, grammar in (("schema", schema), ("any JSON", any_json)):
        matcher = xgr.GrammarMatcher(grammar)
        bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
        times = []
        for token in ids:
            times.append(timed(lambda: matcher.fill_next_token_bitmask(bitmask))[1])
            assert matcher.accept_token(token), token
        print(f"  {name}: mask median {statistics.median(times) * 1e6:.0f} us, max {max(times) * 1e6:.0f} us")


def llguidance_run(tokenizer, ids: list[int]) -> None:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltokenizer, info_s = timed(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB))
    matcher, matcher_s = timed(lambda: llguidance.LLMatcher(
        lltokenizer, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)))
    assert not matcher.is_error(), matcher.get_error()
    bitmask = llguidance.torch.allocate_token_bitmask(1, lltokenizer.vocab_size)
    times = []
    for token in ids:
        times.append(timed(lambda: llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0))[1])
        assert matcher.consume_token(token), (token, matcher.get_error())
    print(f"llguidance: tokenizer {info_s * 1e3:.0f} ms, schema matcher {matcher_s * 1e3:.0f} ms, "
          f"mask median {statistics.median(times) * 1e6:.0f} us, max {max(times) * 1e6:.0f} us")


def main() -> None:
    gguf = Path.home() / ".cache/specdecode/demo/qwen2.5-coder-1.5b-instruct.gguf"
    tokenizer = AutoTokenizer.from_pretrained(cached_tokenizer_folder(gguf))
    ids = tokenizer.encode(json.dumps(DOCUMENT))
    print(f"a {len(ids)}-token document")
    xgrammar_run(tokenizer, ids)
    llguidance_run(tokenizer, ids)


if __name__ == "__main__":
    main()
