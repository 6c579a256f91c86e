"""How close any lookup drafter could come: a bench run's greedy outputs decoded again, offline,
by auto's batch policy, by llama.cpp's ``ngram-mod`` and by a hindsight bound no lookup can
beat, all priced by one measured table of this machine's pass costs (issue 45's one-client
target).

    specdecode bench --methods none@llama.cpp,auto@llama.cpp --prompts agentic \\
        --max-new-tokens 256 --oracle --out agentic
    python benchmarks/lookup_bound.py agentic/results.json

Every lookup drafter (prompt lookup, suffix decoding, llama.cpp's ``ngram-mod`` and
``ngram-cache``) proposes tokens that followed some earlier occurrence of the current context
in the text it has seen. So at position ``i`` of a turn's output ``y`` none can have more of its
draft accepted than the longest run ``y[i:i + n]`` that also starts somewhere in the prompt or
in ``y[:i]`` (and ends inside it): its **copy run**. The bound lets every step draft any prefix
of the copy run at ``i`` (up to ``--cap`` tokens), or with the draft model its teacher-forced
run (``bench/oracle.draft_model_runs``, paying a draft pass per token), or decode plainly, and
takes the cheapest schedule (``bench/oracle.best_schedule``). It knows where every copy ends
and which occurrence continues: a ceiling, not a policy.

``ngram-mod`` is replayed as llama.cpp's ``common/speculative.cpp`` drafts (n_match 24, n_min
48, n_max 64, llama-server's ``--spec-type ngram-mod``): one table from the last 24 tokens to
the next, kept across requests as the server keeps it, filled from each prompt and, 32 tokens
behind, from the output; a draft is the table's chain of at least 48 tokens (at most 64), or
none; five drafts in a row under a quarter accepted clear the table. Its hash table's
collisions are left out (an exact map). Auto is ``auto_policy_sim.simulate_turn_batch``.

Printed per prompt and overall: decode tokens per second (prefill and the first token left
out, as the oracle does) of plain decoding, auto, ngram-mod and the bound, with the same
table. Times are the table's, not measured runs: the ratios say what the policies would give
on this machine's passes.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Sequence

from auto_policy_sim import simulate_turn_batch
from priced_sessions import cost_table

from specdecode import SpecDecoder
from specdecode.bench.oracle import CostTable, Proposals, best_schedule, draft_model_runs
from specdecode.drafters.suffix_cache import SuffixCache

NGRAM_MOD = (24, 48, 64)  # llama.cpp's n_match, n_min, n_max for --spec-type ngram-mod
NGRAM_MOD_LAG = 32  # output n-grams join its table in chunks, this many tokens behind
NGRAM_MOD_LOW = (0.25, 5)  # a draft under this share accepted, this many in a row: cleared


def copy_runs(context: Sequence[int], y: Sequence[int], cap: int) -> list[int]:
    """Per position i: the longest n <= cap with y[i:i + n] equal to text[j:j + n] for some j,
    where text = context + y[:i] and j + n <= len(text) (a lookup proposes what it has seen)."""
    text = list(context) + list(y)
    where: dict[int, list[int]] = defaultdict(list)
    for j, token in enumerate(context):
        where[token].append(j)
    runs = []
    for i, token in enumerate(y):
        end, best = len(context) + i, 0
        for j in where[token]:
            n = 0
            while n < cap and j + n < end and i + n < len(y) and text[j + n] == y[i + n]:
                n += 1
            best = max(best, n)
        runs.append(best)
        where[token].append(len(context) + i)
    return runs


class NgramMod:
    """llama.cpp's ngram-mod drafter, replayed exactly but for hash collisions (module docstring)."""

    def __init__(self) -> None:
        self.n, self.n_min, self.n_max = NGRAM_MOD
        self.table: dict[tuple[int, ...], int] = {}
        self.low = 0
        self.drafts: list[tuple[int, int]] = []  # (drafted, accepted) of every draft, for inspection

    def _add(self, tokens: Sequence[int], begin: int, end: int) -> None:
        for i in range(begin, end):
            self.table[tuple(tokens[i : i + self.n])] = tokens[i + self.n]

    def seconds(self, prompt: Sequence[int], y: Sequence[int], costs: CostTable) -> float:
        """Priced seconds of decoding ``y`` after ``prompt`` (prefill and y[0] excluded)."""
        text = list(prompt) + list(y)
        self._add(text, 0, max(0, len(prompt) - self.n))
        added = len(prompt) - self.n  # llama.cpp's i_last
        seconds, i = 0.0, 1
        while i < len(y):
            known = len(prompt) + i
            if added + NGRAM_MOD_LAG < known:
                self._add(text, added, known - self.n)
                added = known - self.n
            chain = text[known - self.n : known]
            while len(chain) - self.n < self.n_max and (token := self.table.get(tuple(chain[-self.n :]))) is not None:
                chain.append(token)
            draft = chain[self.n :] if len(chain) - self.n >= self.n_min else []
            accepted = 0
            while accepted < len(draft) and i + accepted < len(y) and draft[accepted] == y[i + accepted]:
                accepted += 1
            if draft:
                self.drafts.append((len(draft), accepted))
                share, streak = NGRAM_MOD_LOW
                self.low = self.low + 1 if accepted / len(draft) < share else 0
                if self.low >= streak:
                    self.table.clear()
                    self.low, added = 0, 0
            seconds += costs.target(len(draft) + 1)
            i += accepted + 1
        return seconds


def bound_seconds(decoder: SpecDecoder | None, prompt: list[int], y: list[int], costs: CostTable, cap: int,
                  with_draft: bool) -> float:
    """The cheapest schedule of copy runs (and the draft model's runs) over ``y``."""
    proposals = Proposals(len(y))
    # A draft of k <= run tokens is accepted whole; a longer one would add rows, not tokens.
    proposals.accepted["copy"] = [list(range(1, run + 1)) for run in copy_runs(prompt, y, cap)]
    if with_draft and decoder is not None and decoder.resources.draft_model is not None:
        runs = draft_model_runs(decoder, prompt, y)
        proposals.accepted["draft"] = [list(range(1, run + 1)) for run in runs]
    return best_schedule(proposals, costs)[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="a bench run's results.json holding plain decoding's outputs (method none)")
    parser.add_argument("--target", default=None, help="the run's target (its tokenizer encodes the prompts)")
    parser.add_argument("--cap", type=int, default=128, help="the longest draft the bound and the table go to")
    parser.add_argument("--no-draft", action="store_true", help="leave the draft model out of the bound")
    parser.add_argument("--verify-ms", default=None,
                        help="a measured table instead of the decoder's, rows:ms pairs (e.g. the output of "
                             "verify_rows_logits.py --context 1024): 1:44.5,2:74.2,4:126.3,...")
    args = parser.parse_args()
    run = json.load(open(args.results))
    plain_key = next(r["method"] for r in run["records"] if r["method"].partition("@")[0] == "none")
    decoder = SpecDecoder.from_pretrained(args.target, method="none" if args.no_draft else "draft", backend=plain_key.partition("@")[2] or "auto",
                                          show_progress=False)
    costs = cost_table(decoder, args.cap + 1, args.verify_ms)  # this machine's (stored, or timed now) or the given
    print("pass seconds by rows:", {r: round(costs.target(r), 4) for r in (1, 2, 4, 8, 16, 32, 64, args.cap + 1)},
          f"draft pass {costs.draft_pass:.4f}")
    records = {(r["method"], r["prompt_id"]): r for r in run["records"]}
    # One suffix cache and one ngram-mod table for the whole run, as a server keeps them.
    cache, ngram_mod = SuffixCache(), NgramMod()
    totals: dict[str, float] = defaultdict(float)
    print(f"{'prompt':>26} {'tokens':>6} | decode tok/s: {'plain':>6} {'auto':>6} {'ngram-mod':>9} {'bound':>6}")
    for prompt in run["prompts"]:
        record = records.get((plain_key, prompt["prompt_id"]))
        if record is None:
            continue
        messages: list[dict[str, str]] = []
        seconds: dict[str, float] = defaultdict(float)
        tokens = 0
        for turn, plain in zip(prompt["turns"], record["repeats"][0]):
            messages.append({"role": "user", "content": turn})
            ids, y = decoder.encode(messages, chat=True), plain["tokens"]
            seconds["plain"] += costs.target(1) * (len(y) - 1)
            seconds["auto"] += simulate_turn_batch(ids, y, costs, cache, defaultdict(int))
            seconds["ngram-mod"] += ngram_mod.seconds(ids, y, costs)
            seconds["bound"] += bound_seconds(decoder, ids, y, costs, args.cap, not args.no_draft)
            tokens += len(y) - 1
            messages.append({"role": "assistant", "content": plain["text"]})
        rates = {name: tokens / s for name, s in seconds.items()}
        print(f"{prompt['prompt_id']:>26} {tokens:>6} | {'':>13} {rates['plain']:>6.1f} {rates['auto']:>6.1f} "
              f"{rates['ngram-mod']:>9.1f} {rates['bound']:>6.1f}")
        totals["tokens"] += tokens
        for name, s in seconds.items():
            totals[name] += s
    rates = {name: totals["tokens"] / totals[name] for name in ("plain", "auto", "ngram-mod", "bound")}
    print(f"{'all':>26} {int(totals['tokens']):>6} | {'':>13} {rates['plain']:>6.1f} {rates['auto']:>6.1f} "
          f"{rates['ngram-mod']:>9.1f} {rates['bound']:>6.1f}")
    print(f"bound: {rates['bound'] / rates['plain']:.2f}x plain, {rates['bound'] / rates['ngram-mod']:.2f}x ngram-mod; "
          f"auto {rates['auto'] / rates['ngram-mod']:.2f}x ngram-mod, {rates['auto'] / rates['bound']:.2f} of the bound")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
