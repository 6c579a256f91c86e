"""A request's grammar is bounded: refused before decoding where some way through it cannot end,
compiled under a deadline and a memory bound in a child process, kept within a byte bound, and
its forced text drafted a few tokens at a time.

The grammars here are the hostile ones of issue 49 (each took a server down or a core for
minutes before). Tests that compile them run the compile in the child process, so a regression
there fails on the deadline instead of eating this process's memory.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

xgr = pytest.importorskip("xgrammar")

from specdecode.config import StructuredOutput  # noqa: E402
from specdecode.engine.grammar import GrammarCompiler  # noqa: E402
from specdecode.engine.grammar_check import check_grammar  # noqa: E402
from specdecode.engine.grammar_process import CompileProcess  # noqa: E402
from specdecode.errors import InvalidRequestError  # noqa: E402

# A required property that holds its own schema: no JSON value is finite.
SELF_REQUIRED = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
# The same property optional: {} ends it.
SELF_OPTIONAL = {"type": "object", "properties": {"a": {"$ref": "#"}}}
# Compiles in about a second with the tiny 512-token vocabulary (0.65 s for 500 properties on 2 cores);
# with the demo's 151k vocabulary, regexes such as ((a{0,99}){0,99}){0,99} took minutes.
SLOW_SCHEMA = {"type": "object", "required": [f"k{i}" for i in range(900)],
               "properties": {f"k{i}": {"type": "string", "pattern": "[a-z]{1,%d}" % (i % 50 + 1)} for i in range(900)}}
TIGHT_TIMEOUT = 0.25


@pytest.mark.parametrize(("grammar", "problem"), [
    (xgr.Grammar.from_ebnf('root ::= "a" root'), "no finite string"),
    (xgr.Grammar.from_ebnf('root ::= x\nx ::= y\ny ::= x'), "no finite string"),
    (xgr.Grammar.from_regex("[^\\s\\S]"), "no finite string"),
    (xgr.Grammar.from_ebnf('root ::= "a" | "b" x\nx ::= "c" x'), "rule 'x' can be entered but never ends"),
    (xgr.Grammar.from_json_schema(json.dumps(SELF_REQUIRED)), "no finite string"),
])
def test_grammars_in_which_a_way_cannot_end_are_named(grammar, problem: str) -> None:
    found = check_grammar(grammar.serialize_json())
    assert found is not None and problem in found


@pytest.mark.parametrize("grammar", [
    xgr.Grammar.from_ebnf('root ::= "a" root | "b"'),
    xgr.Grammar.builtin_json_grammar(),
    xgr.Grammar.from_json_schema(json.dumps(SELF_OPTIONAL)),
    xgr.Grammar.from_regex("[a-z]+@[a-z]+\\.com"),
    xgr.Grammar.from_regex("a{3,5}b|yes|no"),
    xgr.Grammar.from_regex("[^a]"),
])
def test_grammars_whose_every_way_ends_pass(grammar) -> None:
    assert check_grammar(grammar.serialize_json()) is None


@pytest.fixture(scope="module")
def compiler(tiny_qwen2_dir: Path) -> GrammarCompiler:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], timeout=5.0)


@pytest.mark.parametrize("spec", [
    StructuredOutput(grammar='root ::= "a" root'),
    StructuredOutput(grammar='root ::= x\nx ::= y\ny ::= x'),
    StructuredOutput(regex="[^\\s\\S]"),
    StructuredOutput(json_schema=SELF_REQUIRED),
])
def test_the_compiler_refuses_them_before_decoding(compiler: GrammarCompiler, spec: StructuredOutput) -> None:
    with pytest.raises(InvalidRequestError, match="cannot be followed"):
        compiler.compile(spec)


def test_a_compile_past_its_deadline_is_stopped_and_the_next_compiles(compiler: GrammarCompiler) -> None:
    tight = GrammarCompiler(compiler.tokenizer, compiler.vocab_size, compiler.stop_token_ids, timeout=TIGHT_TIMEOUT)
    tight.warm()
    process = tight._compile_process()
    starts = process.starts
    started = time.monotonic()
    with pytest.raises(InvalidRequestError, match=f"did not compile within .*grammar_timeout={TIGHT_TIMEOUT:g}"):
        tight.compile(StructuredOutput(json_schema=SLOW_SCHEMA))
    assert time.monotonic() - started < TIGHT_TIMEOUT + 2.0  # stopped at the deadline, not after the compile
    assert process.pid is None  # the child was killed, not left compiling
    # Sent again: refused at once from the failures remembered, without compiling again.
    started = time.monotonic()
    with pytest.raises(InvalidRequestError, match="did not compile within"):
        tight.compile(StructuredOutput(json_schema=SLOW_SCHEMA))
    assert time.monotonic() - started < 0.5
    # The next spec gets a new child and compiles.
    assert tight.compile(StructuredOutput(regex="(yes|no)!")).compiled is not None
    assert process.starts == starts + 1


def test_a_compile_past_the_memory_bound_is_stopped(compiler: GrammarCompiler) -> None:
    process = CompileProcess(compiler._tokenizer_info().serialize_json(), memory_limit_bytes=1)
    try:
        with pytest.raises(InvalidRequestError, match="too large to compile"):
            process.compile("json_schema", [json.dumps(SLOW_SCHEMA)], {}, "JSON schema", timeout=60.0)
        assert process.pid is None
    finally:
        process.close()


def test_the_compile_process_runs_at_the_lowest_priority(compiler: GrammarCompiler) -> None:
    """Compiles take the cores decoding leaves idle: a request without a grammar is not slowed."""
    compiler.warm()
    pid = compiler._compile_process().pid
    assert pid is not None
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    assert int(fields[16]) == 19  # nice, the 19th field of /proc/PID/stat


def test_the_cache_keeps_the_most_recently_used_within_its_bytes(tiny_qwen2_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    schemas = [{"type": "object", "properties": {f"p{i}x": {"type": "integer"}}, "required": [f"p{i}x"]}
               for i in range(12)]
    unbounded = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    sizes = [unbounded._compile(StructuredOutput(json_schema=s), *_call(s)).memory_size_bytes for s in schemas[:1]]
    bound = sizes[0] * 4  # room for about four
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], cache_bytes=bound)
    for i, schema in enumerate(schemas):
        compiler.compile(StructuredOutput(json_schema=schema))
        compiler.compile(StructuredOutput(json_schema=schemas[0]))  # kept in use: never the least recent
        assert compiler.cached_bytes <= bound, f"after {i + 1} schemas"
    kept = list(compiler._cache)
    assert 2 <= len(kept) < len(schemas)
    assert "p0x" in kept[-1] and "p11x" in kept[-2]  # the one in use, then the newest


def _call(schema: dict) -> tuple:
    from specdecode.engine.grammar import _compile_call

    return _compile_call(StructuredOutput(json_schema=schema))


def test_forced_text_is_drafted_a_few_tokens_at_a_time(compiler: GrammarCompiler) -> None:
    """A forced run of 20,000 characters: each step drafts at most its limit, in bounded time."""
    long_text = "ab" * 10_000
    grammar = compiler.compile(StructuredOutput(grammar=f'root ::= "{long_text}" [0-9]'))
    state = grammar.state()
    started = time.perf_counter()
    forced = state.forced_tokens(4)
    assert 0 < len(forced) <= 4
    assert time.perf_counter() - started < 1.0
    state.advance(forced)
    assert 0 < len(state.forced_tokens(4)) <= 4
