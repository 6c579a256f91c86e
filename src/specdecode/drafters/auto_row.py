"""Method auto in the batch engine: one row's choice of source and draft length, every step.

The batched twin of ``AutoDrafter`` (drafters/auto.py, whose docstring says what auto is). Each
step the row runs both lookups on the host, prompt lookup (``NgramDrafter``) and the suffix
chain (``SuffixDrafter``: the request's text and its group's earlier responses), and offers
what they found to the batch's draft-length choice (``costs/batch_k.py``) as ``RowChoices``:
each lookup at the rate its offers agreed with the tokens the target then emitted, scored
every step whether it drafted or not and kept in two states, after an agreement or a miss
(``LookupAgreement``), except that a suffix chain below a long match (``LONG_MATCH`` tokens or
more, right after an offer that agreed) is priced at least at its own calibrated per-token
probability (below); the draft model, where the row holds draft KV, at the row's measured
acceptance (the engine adds that option: ``engine/batch_proposals.plan_row``). ``BatchK``
prices every option as the batch pass it rides in and says which one the row drafts and how
many of its tokens (``choose``), or none: a plain step. The row then hands the chosen lookup's
tokens to the engine (``match``); the draft model drafts in the batch's model pass.

Why a long match is priced by its chain: inside a copy (an agent rewriting its last answer, a
summary quoting its source) the agreement rate is learnt one token per plain step and starts
each request at its prior, so a turn decoded 15-40 plain steps before its first long chain
(benchmarks/lookup_bound.py's replays); the suffix proposer's calibration (drafted edges
accepted over the edges its counts predicted, per match-length bucket, pooled over the group's
requests) already says how far such a chain holds. On the bench's default prompts it raised
auto's share of the oracle from 0.893 to 0.915 (summarization 0.82 to 0.86, humaneval 0.80 to
0.90, no category lower by more than 0.01; RESULTS 2026-12-07); counting shorter matches too
gained nothing in replays (benchmarks/auto_policy_sim.py), their counts say little.

Unlike ``AutoDrafter`` the draft model is priced by its per-token acceptance and the batch's
measured pass costs (as the batch prices method draft), not by its own measured goodput: in a
batch its passes are shared by every row that drafts with it, so one row's seconds mean
little. A row whose draft estimate fell stays off the model until the batch's probes (after
plain steps) let it draft again. Choosing changes only what is proposed, never the
acceptance rule: output stays lossless.
"""

from __future__ import annotations

from collections import Counter

from specdecode.costs.batch_k import BatchRow, RowChoices
from specdecode.drafters.auto import AFTER_AGREEMENT, LOOKUP_SOURCES, LookupAgreement
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.drafters.suffix_tree import Draft

PLAIN = "none"  # the source of a step that drafted nothing, as the single path counts it
MODEL = "draft"
# A suffix match at least this long (the calibration's 8-15 bucket and up), right after an
# agreement, prices its chain at least at the chain's calibrated probability (module docstring).
LONG_MATCH = 8


class AutoRow:
    """A batch row's host drafter for method auto (the module docstring)."""

    def __init__(self, ngram: NgramDrafter, suffix: SuffixDrafter, ngram_cap: int) -> None:
        self.ngram = ngram
        self.suffix = suffix
        self.ngram_cap = ngram_cap  # the most tokens prompt lookup drafts (the engine's k_max)
        # A suffix chain drafts as deep as its proposer goes (``AUTO_DEPTH``, past k_max, as on
        # the single path): it costs no pass per token, and its proposer, given the target's
        # pass costs, stops where a longer chain would not pay (``SuffixProposer._choose``).
        self.suffix_cap = suffix.proposer.depth
        self.agreement = {source: LookupAgreement() for source in LOOKUP_SOURCES}
        # Steps each source drafted (PLAIN: none did); the request's GenerationStats holds it.
        self.steps_by_source: Counter[str] = Counter()
        self.source = PLAIN  # this step's choice
        self._offers: dict[str, list[int]] = {}
        self._chain = Draft()
        self._labels: list[str] = []  # the source of each option offered this step

    @property
    def history(self) -> list[int]:
        return self.ngram.history

    @property
    def drafts_with_model(self) -> bool:
        """Whether the draft model drafts for this row this step."""
        return self.source == MODEL

    def start(self, prompt_len: int, capacity: int) -> None:
        self.ngram.start(prompt_len, capacity)
        self.suffix.start(prompt_len, capacity)

    def extend(self, tokens: list[int]) -> None:
        """Newly committed tokens: they score this step's offers, then join both lookups."""
        if not tokens:  # nothing committed since the offers: nothing to score them by
            return
        for agreement in self.agreement.values():
            agreement.score(tokens)
        self.ngram.extend(tokens)
        self.suffix.extend(tokens)

    def choices(self, remaining: int, model: BatchRow | None) -> RowChoices:
        """This step's options: each lookup that found tokens (at most its cap and
        ``remaining - 1``: a step emits its drafts and one more), then ``model`` (the draft
        model's option, None where the row has none). The offers are kept to be scored by the
        tokens committed next, whichever source steps."""
        cap = max(0, min(self.ngram_cap, remaining - 1))
        lookup = self.ngram.match(cap)[0] if cap else []
        cap = max(0, min(self.suffix_cap, remaining - 1))
        # Only looked at (mark=False): calibrated by the committed tokens only if drafted (``match``).
        self._chain = self.suffix.proposer.propose(cap, tree=False, mark=False) if cap else Draft()
        self._offers = {"ngram": lookup, "suffix": list(self._chain.tokens)}
        self._labels, options = [], []
        for source, tokens in self._offers.items():
            self.agreement[source].offer(tokens)
            if tokens:
                self._labels.append(source)
                # Scored every step (drafted or not): an observed rate, never a guess to probe.
                rate = self.agreement[source].rate
                if source == "suffix":
                    rate = max(rate, self._long_match_rate())
                options.append(BatchRow(rate, len(tokens), uses_draft_model=False, remaining=remaining))
        if model is not None:
            self._labels.append(MODEL)
            options.append(model)
        self.source = PLAIN
        return RowChoices(tuple(options))

    def _long_match_rate(self) -> float:
        """The suffix chain's calibrated per-token probability (the geometric mean of its
        edges' along the path) where it continues a long match after an agreement; else 0."""
        chain = self._chain
        if chain.match_len < LONG_MATCH or not chain.tokens or self.agreement["suffix"].state != AFTER_AGREEMENT:
            return 0.0
        path = self.suffix.proposer.calibrated(chain)[-1]
        return path ** (1.0 / len(chain.tokens))

    def choose(self, option: int | None) -> None:
        """The batch chose this row's ``option`` (an index into the last ``choices``; None: plain)."""
        self.source = PLAIN if option is None else self._labels[option]

    def match(self, num_tokens: int) -> tuple[list[int], int]:
        """The chosen lookup's first ``num_tokens`` tokens (the engine's host-drafter call); none
        where the draft model or plain decoding steps."""
        if self.source == "suffix":
            kept = self.suffix.proposer.keep(self._chain, num_tokens)  # calibrated once verified
            return list(kept.tokens), self._chain.match_len
        if self.source == "ngram":
            return self._offers["ngram"][:num_tokens], 0
        return [], 0

    def observe(self, proposed: int) -> None:
        """The step verified ``proposed`` tokens of this row's choice (0: a plain step)."""
        self.steps_by_source[self.source if proposed else PLAIN] += 1
