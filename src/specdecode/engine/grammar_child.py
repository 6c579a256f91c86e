"""How a spec becomes a checked, compiled grammar; and, run by path, the compile child process.

``build_and_compile`` is the one way: build xgrammar's ``Grammar`` from the spec's builder
(``BUILDERS``), refuse it where some way through it cannot end (``grammar_check.py``: before the
compile, which itself never ends on ``root ::= "a" root``), then compile it. The server runs it in
the child (``engine/grammar_process.py`` starts this file by path); a caller that trusts its
specs runs it in its own thread.

The child imports xgrammar, the standard library and ``grammar_check.py`` (loaded by path: it
imports only the standard library), so that it starts in about as long as xgrammar takes to
import and holds nothing of the server's. Protocol, one JSON object a line: the first line on
stdin carries the tokenizer info (xgrammar's ``serialize_json``) and the compile threads; the
child answers ``{"ready": true}``. Each later line is a job ``{"builder", "args", "kwargs"}``; the
answer is ``{"compiled": <CompiledGrammar.serialize_json()>}``, ``{"refused": <what cannot end>}``
or ``{"error": <xgrammar's first line>}``. The child ends when stdin closes (its parent is gone)
or it is killed (past a deadline or a memory bound).
"""

import importlib.util
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The Grammar constructors a job may name: nothing else of xgrammar is reachable from a request.
BUILDERS = {"json_schema": "from_json_schema", "regex": "from_regex", "structural_tag": "from_structural_tag",
            "ebnf": "from_ebnf"}


class GrammarRefused(Exception):
    """A grammar in which some way cannot end (its message says where)."""


def build_and_compile(xgr: Any, compiler: Any, check: Callable[[str], str | None], builder: str,
                      args: list[Any], kwargs: dict[str, Any]) -> Any:
    """xgrammar's compiled grammar; GrammarRefused from ``check``, or xgrammar's own errors."""
    if builder not in BUILDERS:
        raise ValueError(f"unknown grammar builder {builder!r}")
    grammar = getattr(xgr.Grammar, BUILDERS[builder])(*args, **kwargs)
    problem = check(grammar.serialize_json())
    if problem is not None:
        raise GrammarRefused(problem)
    return compiler.compile_grammar(grammar)


def _load_check() -> Callable[[str], str | None]:
    spec = importlib.util.spec_from_file_location("grammar_check", Path(__file__).with_name("grammar_check.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.check_grammar  # type: ignore[no-any-return]


def first_line(err: BaseException) -> str:
    """xgrammar's message without its C++ trace."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def main() -> None:
    try:
        os.nice(19)  # compiles take the cores decoding leaves idle, never the other way round
    except OSError:
        pass
    # The protocol owns the real stdout; anything xgrammar or its imports print goes to stderr.
    channel = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    import xgrammar as xgr

    header = json.loads(sys.stdin.readline())
    info = xgr.TokenizerInfo.deserialize_json(header["tokenizer_info"])
    # No cache here: the parent keeps compiled grammars (bounded in bytes) and this process may
    # be killed at any time.
    compiler = xgr.GrammarCompiler(info, max_threads=header["threads"], cache_enabled=False)
    check = _load_check()
    channel.write(json.dumps({"ready": True}) + "\n")
    channel.flush()
    for line in sys.stdin:
        try:
            job = json.loads(line)
            compiled = build_and_compile(xgr, compiler, check, job["builder"], job["args"], job["kwargs"])
            reply = {"compiled": compiled.serialize_json()}
        except GrammarRefused as err:
            reply = {"refused": str(err)}
        except Exception as err:  # noqa: BLE001 - every failure is the job's, told to the parent
            reply = {"error": first_line(err)}
        channel.write(json.dumps(reply) + "\n")
        channel.flush()


if __name__ == "__main__":
    main()
