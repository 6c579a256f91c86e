"""What the batch engine keeps per request, what a step hands back for it, and the sampling
generator snapshots a failed step is rerun from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdecode.config import SamplingParams
from specdecode.core.device import host_to_device
from specdecode.core.logprobs import TokenLogprob
from specdecode.core.sampling import LogitsProcessor, make_generator
from specdecode.costs.k_policy import AcceptanceEstimate, KSchedule
from specdecode.drafters.auto_row import AutoRow
from specdecode.drafters.base import DraftProposal, TreeDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.suffix import SuffixDrafter, SuffixTreeDrafter
from specdecode.engine.batch_rows import RowDrafters
from specdecode.engine.grammar import CompiledGrammar, GrammarState
from specdecode.engine.metrics import GenerationStats
from specdecode.engine.penalties import TokenPenalties, wants_penalties
from specdecode.engine.scheduler import ScheduledSequence


@dataclass(slots=True)
class RequestOutput:
    """What one step did for one request."""

    request_id: str
    new_tokens: list[int]
    finished: bool
    stats: GenerationStats
    error: BaseException | None = None
    drafted: int = 0  # of new_tokens, the first this many are accepted drafts (the rest the target's)


@dataclass(slots=True, eq=False)
class BatchRequest:
    """One request's state inside the batch engine (the scheduler's ``ScheduledSequence.state``)."""

    request_id: str
    params: SamplingParams
    method: str
    k: int  # the most tokens this request lets a step draft
    processor: LogitsProcessor
    generator: torch.Generator | None
    tokens: list[int]  # committed, host
    committed: torch.Tensor  # (capacity,) long, device: the same tokens
    stats: GenerationStats
    started: float
    # The acceptance of its drafter's drafts (a row that picks its source: the draft model's;
    # its lookups keep their own scores, drafters/auto_row.py).
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    ngram: NgramDrafter | SuffixDrafter | SuffixTreeDrafter | AutoRow | None = None  # a host-side drafter (engine/batch_rows.py)
    tree_nodes: int = 0  # the most nodes the host drafter's token trees hold (0: it drafts chains)
    sources: AutoRow | None = None  # the same object as ``ngram`` where the row picks its source every step
    grammar: GrammarState | None = None  # structured output: the matcher over committed tokens
    heads: TreeDrafter | None = None  # its own Medusa or EAGLE drafter (engine/batch_rows.py)
    skips_layers: bool = False  # the target drafts for it with layers skipped
    schedule: KSchedule | None = None  # its own draft length (fixed or threshold k policy); None: the batch's
    # The last verify pass's logprobs of this row's emitted tokens (SamplingParams.logprobs),
    # kept by the commit that follows it.
    step_logprobs: list[TokenLogprob] | None = None
    # How its sampled token trees are verified (config.ACCEPTANCE_RULES): "lossless", or
    # "typical", Medusa's lossy rule, which a caller of a tree method opts into.
    acceptance_rule: str = "lossless"

    @classmethod
    def start(
        cls,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        method: str,
        k: int,
        drafters: RowDrafters,
        grammar: CompiledGrammar | None,
        vocab_size: int,
        device: torch.device,
        stats: GenerationStats,
        started: float,
        acceptance_rule: str = "lossless",
    ) -> BatchRequest:
        """A new request's state: its committed tokens (room for all it may generate), its logits
        processor (grammar, penalties), generator and drafters, its stats begun."""
        prompt_len = len(prompt_ids)
        capacity = prompt_len + params.max_new_tokens
        committed = torch.zeros(capacity + 1, dtype=torch.long, device=device)
        committed[:prompt_len] = host_to_device(list(prompt_ids), torch.long, device)
        state = grammar.state() if grammar is not None else None
        penalties = TokenPenalties(params, prompt_ids, vocab_size, device) if wants_penalties(params) else None
        processor = LogitsProcessor.from_params(params, state, penalties)
        request = cls(
            request_id=request_id, params=params, method=method, k=k, processor=processor,
            generator=None if processor.greedy else make_generator(params.seed, device),
            tokens=list(prompt_ids), committed=committed, stats=stats, started=started,
            ngram=drafters.host, sources=drafters.sources, tree_nodes=drafters.tree_nodes, grammar=state,
            heads=drafters.heads, skips_layers=drafters.skips_layers, schedule=drafters.schedule,
            acceptance_rule=acceptance_rule,
        )
        stats.method, stats.prompt_tokens = method, prompt_len
        if drafters.sources is not None:
            stats.steps_by_source = drafters.sources.steps_by_source  # filled as it decodes
        if params.logprobs is not None:
            stats.token_logprobs = []
        if request.ngram is not None:
            request.ngram.start(prompt_len, capacity)
        if request.heads is not None:  # it hears the features of the prompt (prefill) and of each step
            request.heads.start(prompt_len, capacity)
        return request

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - self.stats.new_tokens

    def record_step(self, proposal: DraftProposal, accepted_len: int, draft_seconds: float, verify_seconds: float,
                    draft_passes: int, prefilling: bool) -> None:
        """Count one step in the request's stats (``draft_passes``: the draft model's, where it
        drafted for this row)."""
        stats = self.stats
        stats.draft_seconds += draft_seconds
        if prefilling:  # this step fed its prompt's last chunk: mostly prefill time
            stats.prefill_seconds += verify_seconds
        else:
            stats.verify_seconds += verify_seconds
        stats.draft_forward_passes += draft_passes
        if proposal.forced:
            stats.record_forced_step(proposal.num_tokens, accepted_len)
            return
        stats.record_step(proposal.depth, accepted_len)  # a tree: its depth, the most it could accept
        if self.schedule is not None and proposal.num_tokens:
            self.schedule.observe(proposal.num_tokens, accepted_len, draft_seconds, draft_passes, None)
        if proposal.tree is not None:
            stats.tree_nodes_proposed += proposal.num_tokens
        if self.sources is not None:
            self.sources.observe(proposal.num_tokens)

    def observe_features(self, hidden: torch.Tensor, path: list[int] | None, accepted: int, start: int) -> None:
        """Show its heads the target's features (hidden: (T, C), its row of the verify pass from
        position ``start``) of the positions it kept: a tree's accepted ``path``, else its first
        ``accepted`` + 1, root first."""
        assert self.heads is not None
        kept = path[: accepted + 1] if path is not None else list(range(accepted + 1))
        # Index with a device tensor: a list index is copied from pageable memory (a sync on GPUs).
        self.heads.observe(hidden[None, host_to_device(kept, torch.long, hidden.device)], start)

    def append(self, new_tokens: list[int]) -> bool:
        """Commit ``new_tokens`` to the request's state: its tokens (host and device), logprobs,
        penalty counts, grammar and lookups. True where the grammar has ended."""
        count, length = len(new_tokens), len(self.tokens)
        self.committed[length : length + count] = host_to_device(new_tokens, torch.long, self.committed.device)
        self.tokens.extend(new_tokens)
        stats = self.stats
        if self.step_logprobs is not None and stats.token_logprobs is not None:
            stats.token_logprobs.extend(self.step_logprobs[:count])
            self.step_logprobs = None
        if self.processor.penalties is not None:
            self.processor.penalties.advance(self.committed[length : length + count])
        if self.ngram is not None:  # as tokens commit, so other requests draft from them too
            self.ngram.extend(self.tokens[len(self.ngram.history):])
        if self.grammar is None:
            return False
        self.grammar.advance(new_tokens)
        stats.mask_seconds = self.grammar.mask_seconds
        return self.grammar.terminated


def generator_states(running: list[ScheduledSequence]) -> list[tuple[torch.Generator, torch.Tensor]]:
    """Each sampling row's generator and its state (a few KiB on the host), to rerun a step from."""
    requests: list[BatchRequest] = [seq.state for seq in running]
    return [(r.generator, r.generator.get_state()) for r in requests if r.generator is not None]


def restore_generators(states: list[tuple[torch.Generator, torch.Tensor]]) -> None:
    for generator, state in states:
        generator.set_state(state)
