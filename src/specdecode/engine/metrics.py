"""Generation metrics, computed the same way for every method.

tau (mean accepted length) counts the bonus/recovered token: each verification step emits
accepted + 1 tokens, so plain decoding has tau = 1 exactly. The acceptance rate is accepted
draft tokens over proposed draft tokens. Per-position acceptance at draft position i is the
fraction of steps that proposed at least i + 1 tokens in which the first i + 1 were all
accepted (so it can only fall with i).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from specdecode.core.logprobs import TokenLogprob


@dataclass(slots=True)
class GenerationStats:
    method: str = "none"
    prompt_tokens: int = 0
    # Prompt tokens whose K/V came from the prefix cache instead of a prefill (engine/prefix.py).
    cached_tokens: int = 0
    new_tokens: int = 0
    target_forward_passes: int = 0  # prefill included
    draft_forward_passes: int = 0  # forward passes of a draft model (0 for model-free drafters)
    verify_steps: int = 0  # decode passes of the target (each emits accepted + 1 tokens)
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    # Tree methods: proposed counts each tree's depth (the most a step can accept), so the
    # acceptance rate is accepted / depth; the nodes scored are counted here.
    tree_nodes_proposed: int = 0
    emitted_by_steps: int = 0  # sum over steps of accepted + 1, before any truncation
    proposed_at_position: list[int] = field(default_factory=list)
    accepted_at_position: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    # To the first committed tokens, from the start of decoding (batch engine: from its arrival).
    first_token_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    # compile=True: seconds of this request spent compiling passes of shapes not compiled yet
    # (part of draft/verify time; 0 once the decoder is warm, see SpecDecoder.warm_up)
    compile_seconds: float = 0.0
    # Structured outputs: tokens the grammar forced, drafted in place of the drafter's proposal
    # in their own steps, and those the target accepted (not in the draft acceptance figures).
    forced_tokens_proposed: int = 0
    forced_tokens_accepted: int = 0
    # Structured outputs: seconds the grammar's matcher spent on masks and advancing (part of
    # other, or of verify for token trees; engine/grammar.py).
    mask_seconds: float = 0.0
    stop_reason: str = ""
    # stop_reason "stop_string": which of the request's stop strings ended it (Anthropic's stop_sequence).
    stop_string: str | None = None
    # method auto: steps drafted by each source ("ngram", "draft") or decoded plainly ("none")
    steps_by_source: dict[str, int] = field(default_factory=dict)
    # Why the request decoded plainly although it asked for speculation (measured costs), or "".
    note: str = ""
    # SamplingParams.logprobs set: each committed token's log-probability (core/logprobs.py),
    # filled by the engine as tokens commit; not a metric, so not in to_dict.
    token_logprobs: list[TokenLogprob] | None = None

    def record_step(self, proposed: int, accepted: int) -> None:
        self.verify_steps += 1
        self.target_forward_passes += 1
        self.draft_tokens_proposed += proposed
        self.draft_tokens_accepted += accepted
        self.emitted_by_steps += accepted + 1
        while len(self.proposed_at_position) < proposed:
            self.proposed_at_position.append(0)
            self.accepted_at_position.append(0)
        for pos in range(proposed):
            self.proposed_at_position[pos] += 1
            if pos < accepted:
                self.accepted_at_position[pos] += 1

    def record_forced_step(self, proposed: int, accepted: int) -> None:
        """A step that verified the grammar's forced tokens: a target pass and its tokens count
        (tau is tokens per step), the drafter's figures do not."""
        self.verify_steps += 1
        self.target_forward_passes += 1
        self.forced_tokens_proposed += proposed
        self.forced_tokens_accepted += accepted
        self.emitted_by_steps += accepted + 1

    @property
    def acceptance_rate(self) -> float | None:
        if self.draft_tokens_proposed == 0:
            return None
        return self.draft_tokens_accepted / self.draft_tokens_proposed

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_at_position, self.proposed_at_position)]

    @property
    def tau(self) -> float | None:
        return self.emitted_by_steps / self.verify_steps if self.verify_steps else None

    @property
    def other_seconds(self) -> float:
        return max(0.0, self.total_seconds - self.prefill_seconds - self.draft_seconds - self.verify_seconds)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_seconds if self.total_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first over the time after prefill: the steady decoding speed."""
        decode_time = self.total_seconds - self.prefill_seconds
        return (self.new_tokens - 1) / decode_time if decode_time > 0 and self.new_tokens > 1 else 0.0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("token_logprobs")
        # asdict rebuilds a dict field with its own type, and a Counter built from (key, count)
        # pairs counts the pairs: auto's per-source steps would come out keyed by tuples.
        data["steps_by_source"] = dict(self.steps_by_source)
        data.update(
            acceptance_rate=self.acceptance_rate,
            acceptance_per_position=self.acceptance_per_position,
            tau=self.tau,
            other_seconds=self.other_seconds,
            tokens_per_second=self.tokens_per_second,
            decode_tokens_per_second=self.decode_tokens_per_second,
        )
        return data

    def summary(self) -> str:
        """A few human-readable lines for the CLI."""
        parts = [
            (f"method={self.method} new_tokens={self.new_tokens} prompt_tokens={self.prompt_tokens}"
             + (f" (cached {self.cached_tokens})" if self.cached_tokens else "")),
            f"tokens/s={self.tokens_per_second:.2f} (decode {self.decode_tokens_per_second:.2f})"
            f" target_passes={self.target_forward_passes}",
        ]
        if self.tau is not None:
            line = f"tau={self.tau:.2f}"
            if self.acceptance_rate is not None:
                per_pos = " ".join(f"{a:.2f}" for a in self.acceptance_per_position)
                line += f" acceptance={self.acceptance_rate:.2%} per_position=[{per_pos}]"
            parts.append(line)
        if self.tree_nodes_proposed and self.verify_steps:
            parts.append(f"tree nodes per step={self.tree_nodes_proposed / self.verify_steps:.1f} "
                         "(acceptance and per-position figures are per tree depth)")
        if self.forced_tokens_proposed:
            parts.append(f"grammar-forced tokens: {self.forced_tokens_accepted} of {self.forced_tokens_proposed} "
                         "accepted (drafted in their own steps)")
        if self.steps_by_source:
            parts.append("steps by source: " + " ".join(f"{k}={v}" for k, v in sorted(self.steps_by_source.items())))
        if self.note:
            parts.append(self.note)
        parts.append(
            f"time: total={self.total_seconds:.2f}s prefill={self.prefill_seconds:.2f}s "
            f"draft={self.draft_seconds:.2f}s verify={self.verify_seconds:.2f}s other={self.other_seconds:.2f}s"
            + (f" (compiling {self.compile_seconds:.2f}s)" if self.compile_seconds else "")
            + (f" grammar={self.mask_seconds:.3f}s" if self.mask_seconds else "")
        )
        return "\n".join(parts)
