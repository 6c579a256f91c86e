"""What suffix decoding's trees cost on the host: insertion time, draft time and bytes per token.

Builds a tree over N tokens of Python standard-library source (split into words, spaces and
punctuation, each a token id), then adds the same text again (an exact repeat) and a copy with
every 50th token changed (a near repeat), and drafts at 100 places. Bytes are the tree's own
count (``SuffixTree.memory_bytes``, checked against tracemalloc in the tests). With
``arctic_inference`` importable (``pip install arctic-inference``, a C++ build) its suffix tree
is measured on the same tokens, bytes by its own ``estimate_memory``.

    python benchmarks/bench_suffix_tree.py                 # 20,000 tokens, depth bounds 32 and 64
    python benchmarks/bench_suffix_tree.py --tokens 40000 --depths 16,32,64
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import re
import time

from specdecode.drafters.suffix_tree import SuffixTree

DRAFTS = 100
DRAFT_NODES = 16
DRAFT_DEPTH = 8


def stdlib_tokens(count: int) -> list[int]:
    text = "".join(open(inspect.getsourcefile(module)).read() for module in (json.decoder, random, inspect))  # noqa: SIM115
    vocabulary: dict[str, int] = {}
    return [vocabulary.setdefault(word, len(vocabulary) + 300) for word in re.findall(r"\w+|[^\w\s]|\s+", text)][:count]


def ours(tokens: list[int], depth: int) -> dict[str, float]:
    started = time.perf_counter()
    tree = SuffixTree(depth)
    tree.add_sequence(tokens)
    insert = (time.perf_counter() - started) / len(tokens)
    novel = tree.memory_bytes()
    tree.add_sequence(tokens)
    copy = tree.memory_bytes()
    tree.add_sequence([t if i % 50 else 7 for i, t in enumerate(tokens)])
    near = tree.memory_bytes()
    step = max(1, (len(tokens) - 1000) // DRAFTS)
    started = time.perf_counter()
    for i in range(DRAFTS):
        tree.draft(tokens[: 1000 + i * step], max_nodes=DRAFT_NODES, max_depth=DRAFT_DEPTH, min_prob=0.0,
                   max_match=depth - DRAFT_DEPTH)
    draft = (time.perf_counter() - started) / DRAFTS
    n = len(tokens)
    return {"insert_us_per_token": insert * 1e6, "draft_us": draft * 1e6, "novel_bytes_per_token": novel / n,
            "exact_repeat_adds_bytes_per_token": (copy - novel) / n, "near_repeat_adds_bytes_per_token": (near - copy) / n}


def arctic(tokens: list[int], depth: int) -> dict[str, float] | None:
    try:
        from arctic_inference.suffix_decoding._C import SuffixTree as ArcticTree
    except ImportError:
        return None
    started = time.perf_counter()
    tree = ArcticTree(depth)
    tree.extend(0, tokens)
    insert = (time.perf_counter() - started) / len(tokens)
    novel = tree.estimate_memory()
    tree.extend(1, tokens)
    copy = tree.estimate_memory()
    tree.extend(2, [t if i % 50 else 7 for i, t in enumerate(tokens)])
    near = tree.estimate_memory()
    step = max(1, (len(tokens) - 1000) // DRAFTS)
    started = time.perf_counter()
    for i in range(DRAFTS):
        context = tokens[: 1000 + i * step][-(depth - DRAFT_DEPTH):]
        tree.speculate(context, DRAFT_NODES, 1.0, 0.0, 0.0, True)
    draft = (time.perf_counter() - started) / DRAFTS
    n = len(tokens)
    return {"insert_us_per_token": insert * 1e6, "draft_us": draft * 1e6, "novel_bytes_per_token": novel / n,
            "exact_repeat_adds_bytes_per_token": (copy - novel) / n, "near_repeat_adds_bytes_per_token": (near - copy) / n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20_000)
    parser.add_argument("--depths", default="32,64")
    args = parser.parse_args()
    tokens = stdlib_tokens(args.tokens)
    print(f"{len(tokens)} tokens of stdlib source; drafts of {DRAFT_NODES} nodes, {DRAFT_DEPTH} deep")
    header = ("tree", "depth", "insert us/token", "draft us", "novel B/token", "+exact repeat B/token", "+near repeat B/token")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for depth in (int(d) for d in args.depths.split(",")):
        for name, measure in (("specdecode", ours), ("arctic-inference", arctic)):
            figures = measure(tokens, depth)
            if figures is not None:
                print(f"| {name} | {depth} | " + " | ".join(f"{v:.1f}" if v < 10 else f"{v:.0f}" for v in figures.values()) + " |")


if __name__ == "__main__":
    main()
