"""Which layers self-speculation skips: the saved choice, and the search that makes it.

``specdecode tune-layerskip`` searches on a few calibration prompts and writes a small JSON
file (``LayerSkipChoice``, ``drafters/layer_skip_file.py``) that ``generate --method layerskip --layerskip-config FILE`` and
``bench`` load. The search, in order of cost:

1. The target decodes each calibration prompt plainly (greedy): its own continuations are
   the reference, and the same run measures plain tokens/s.
2. One full pass over each prompt + continuation gives every layer's block influence,
   1 - cos(layer input, layer output) averaged over the continuation's positions: how much
   the layer changes the residual stream. Layers that change it least are skipped first;
   the first and last layers are never skipped (they move the stream the most).
3. For each candidate size m (``skip_counts``), skipping the m least influential layers:
   teacher-forced top-1 agreement with the reference continuation (one pass per prompt)
   and the measured cost of one draft pass on this machine give a predicted speedup,
   max over k of E(a, k) / (k draft passes + verify of k + 1 rows) against one plain pass.
4. The ``measure_top`` best predictions are run for real (``generate`` with each candidate's
   layer skip and the batch engine's cost-aware draft length, interleaved with plain decoding
   of the same prompts), and the choice is the one with the highest measured tokens/s, not the
   highest acceptance.

Calibration prompts default to the last rows of each category of the shipped Spec-Bench file
and the last HumanEval problems: apart from every bench subset that takes the first N.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

import torch

from specdecode.backends.select import TORCH
from specdecode.backends.torch_backend import time_passes
from specdecode.config import SamplingParams
from specdecode.core.registry import LAYERSKIP, NONE
from specdecode.costs.k_policy import best_plan
from specdecode.drafters.layer_skip_file import LayerSkipChoice
from specdecode.engine.metrics import GenerationStats
from specdecode.errors import InvalidRequestError
from specdecode.models.llama import Transformer

if TYPE_CHECKING:
    from specdecode.api.decoder import SpecDecoder

DEFAULT_CALIBRATION_PER_CATEGORY = 1
DEFAULT_CALIBRATION_TOKENS = 64
DEFAULT_MEASURE_TOP = 3


def calibration_prompts(per_category: int = DEFAULT_CALIBRATION_PER_CATEGORY) -> list[str]:
    """The last ``per_category`` first-turn prompts of each default category (bench subsets take the first N)."""
    from specdecode.prompt_sets import first_turns_per_category

    return first_turns_per_category(slice(-per_category, None))


@torch.inference_mode()
def block_influence(model: Transformer, sequences: Sequence[tuple[list[int], int]]) -> list[float]:
    """Per layer, 1 - cos(input, output) of the residual stream averaged over the scored positions.

    ``sequences``: (token ids, index of the first scored position) pairs.
    """
    num_layers = model.config.num_layers
    totals = torch.zeros(num_layers, dtype=torch.float64)
    count = 0
    for ids, first in sequences:
        tokens = torch.tensor([ids], device=model.device)
        positions = torch.arange(len(ids), device=model.device)[None]
        out = model(tokens, positions, return_layers=range(num_layers), compute_logits=False)
        previous = model.embed_tokens(tokens)
        for layer in range(num_layers):
            current = out.layer_hidden[layer]
            cos = torch.nn.functional.cosine_similarity(previous[0, first:].float(), current[0, first:].float(), dim=-1)
            totals[layer] += (1 - cos).sum().double().cpu()
            previous = current
        count += len(ids) - first
    return (totals / max(count, 1)).tolist()


@torch.inference_mode()
def teacher_forced_agreement(model: Transformer, kept_layers: Sequence[int], sequences: Sequence[tuple[list[int], int]]) -> float:
    """How often the kept layers' argmax equals the next token of the reference, over scored positions."""
    agree = total = 0
    for ids, first in sequences:
        tokens = torch.tensor([ids], device=model.device)
        positions = torch.arange(len(ids), device=model.device)[None]
        logits = model(tokens, positions, layers=kept_layers).logits[0]  # (T, V)
        predicted = logits[first - 1 : -1].argmax(dim=-1)
        agree += int((predicted == tokens[0, first:]).sum())
        total += len(ids) - first
    return agree / max(total, 1)


@dataclass(slots=True)
class Candidate:
    skip_layers: tuple[int, ...]
    agreement: float  # teacher-forced top-1 agreement
    draft_pass_seconds: float
    predicted_speedup: float
    measured_speedup: float | None = None  # tokens/s against plain decoding, side by side
    measured_tau: float | None = None
    measured_acceptance: float | None = None


def tune_layerskip(
    decoder: SpecDecoder,
    prompts: Sequence[list[int]],
    *,
    max_new_tokens: int = DEFAULT_CALIBRATION_TOKENS,
    skip_counts: Sequence[int] | None = None,
    measure_top: int = DEFAULT_MEASURE_TOP,
    k_max: int = 8,
    log: Callable[[str], None] = print,
) -> LayerSkipChoice:
    """Search the layers to skip for ``decoder``'s target on ``prompts`` (token ids); see the
    module doc. Decoding (the plain reference and the measured candidates) runs as ``generate``
    does, on the batch engine holding one request."""
    if decoder.backend != TORCH:
        raise InvalidRequestError("The layer search runs the torch backend's model with layers skipped; load it with backend='torch'.")
    model = decoder.target.model
    assert isinstance(model, Transformer)
    num_layers = model.config.num_layers
    if num_layers < 3:
        raise InvalidRequestError("layer skip needs a model with at least 3 layers (the first and last are kept).")
    if not prompts:
        raise InvalidRequestError("tune-layerskip needs at least one calibration prompt.")
    if skip_counts is None:
        skip_counts = sorted({m for m in (2, 4, 6, 8, 10, 12, num_layers // 2) if 1 <= m <= num_layers - 2})
    params = SamplingParams(max_new_tokens=max_new_tokens)
    started = time.perf_counter()

    log(f"1/4 plain decoding of {len(prompts)} calibration prompts ({max_new_tokens} tokens each)")
    references = []
    for ids in prompts:
        new = decoder.generate(ids, params, method=NONE.name).token_ids
        references.append((list(ids) + new, len(ids)))
    sequences = [(seq, first) for seq, first in references if len(seq) > first]

    log("2/4 block influence per layer")
    influence = block_influence(model, sequences)
    order = sorted(range(1, num_layers - 1), key=lambda i: influence[i])

    log(f"3/4 predicted speedup for skipping {', '.join(map(str, skip_counts))} layers")
    verify = decoder.engine.verify_costs(k_max + 1)  # one sequence's verify passes, timed (or stored)
    candidates: list[Candidate] = []
    for m in skip_counts:
        skip = tuple(sorted(order[:m]))
        kept = [i for i in range(num_layers) if i not in skip]
        agreement = teacher_forced_agreement(model, kept, sequences)
        draft_seconds = time_passes(model, [1], decoder.kv_dtype, layers=kept)[1]
        _, rate = best_plan(agreement, verify, draft_seconds, k_max, k_min=1)
        candidates.append(Candidate(skip, agreement, draft_seconds, rate * verify[0]))
        log(f"    skip {m:2d}: agreement {agreement:.2f}, draft pass {draft_seconds / verify[0]:.2f} of a target pass, "
            f"predicted {rate * verify[0]:.2f}x")

    best_predicted = sorted(candidates, key=lambda c: c.predicted_speedup, reverse=True)[:measure_top]
    log(f"4/4 measuring the {len(best_predicted)} best predictions against plain decoding, interleaved per prompt")
    plain_seconds = plain_tokens = 0.0
    spec_seconds = [0.0] * len(best_predicted)
    spec_runs: list[list[GenerationStats]] = [[] for _ in best_predicted]
    # Each candidate as a user would run it: a decoder over the same weights whose layer skip
    # drafts with this set, its draft length chosen by the batch engine's cost-aware policy.
    measured_decoders = [type(decoder)(decoder.target, None, replace(
        decoder.config, method=LAYERSKIP.name, skip_layers=cand.skip_layers, k_max=k_max)) for cand in best_predicted]
    for ids in prompts:
        plain = decoder.generate(ids, params, method=NONE.name).stats
        plain_seconds += plain.total_seconds
        plain_tokens += plain.new_tokens
        for index, candidate_decoder in enumerate(measured_decoders):
            spec = candidate_decoder.generate(ids, params).stats
            spec_seconds[index] += spec.total_seconds
            spec_runs[index].append(spec)
    plain_rate = plain_tokens / plain_seconds
    for cand, seconds, runs in zip(best_predicted, spec_seconds, spec_runs):
        # Greedy layer skip reproduces plain decoding, so both produced the same token counts
        # (up to bf16 near-ties); tokens/s is compared on each run's own count.
        cand.measured_speedup = (sum(s.new_tokens for s in runs) / seconds) / plain_rate
        steps = sum(s.verify_steps for s in runs)
        cand.measured_tau = sum(s.emitted_by_steps for s in runs) / steps if steps else None
        proposed = sum(s.draft_tokens_proposed for s in runs)
        cand.measured_acceptance = sum(s.draft_tokens_accepted for s in runs) / proposed if proposed else None
        log(f"    skip {len(cand.skip_layers):2d}: measured {cand.measured_speedup:.2f}x plain, tau {cand.measured_tau or 0:.2f}, "
            f"acceptance {cand.measured_acceptance or 0:.2f}")
    chosen = max(best_predicted, key=lambda c: c.measured_speedup or 0.0)
    return LayerSkipChoice(
        target=decoder.target.name,
        num_layers=num_layers,
        skip_layers=chosen.skip_layers,
        measured={
            "measured_speedup": chosen.measured_speedup,
            "measured_tau": chosen.measured_tau,
            "measured_acceptance": chosen.measured_acceptance,
            "calibration_prompts": len(prompts),
            "max_new_tokens": max_new_tokens,
            "block_influence": [round(v, 5) for v in influence],
            "candidates": [asdict(c) | {"skip_layers": list(c.skip_layers)} for c in candidates],
            "device": str(model.device),
            "dtype": str(model.dtype).removeprefix("torch."),
            "seconds": round(time.perf_counter() - started, 1),
        },
    )
