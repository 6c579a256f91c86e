"""What weight quantization costs in quality: KL to the unquantized model, perplexity, top-1 agreement.

Quantizing the target changes the model whose output speculative decoding reproduces. This
measures by how much, on a fixed text: each variant scores the same token windows in one full
forward pass (no cache), and against the unquantized model's next-token distributions p we
report, pooled over every scored position:

- mean KL(p || p_quant) in nats;
- perplexity exp(mean negative log-likelihood of the actual next token);
- top-1 agreement: how often both models' most likely next token is the same (a greedy
  draft-target pair accepts at most at this rate if one is the other's quantization).

The default text is Python standard-library source (shipped with every Python, and apart
from the bench prompts), which suits the code-model demo pair; pass any text file instead.
"""

from __future__ import annotations

import inspect
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from specdecode.errors import InvalidRequestError

DEFAULT_MODULES = ("textwrap", "json.decoder", "string")
DEFAULT_WINDOW = 512
DEFAULT_MAX_TOKENS = 2048


@dataclass(slots=True)
class QualityRow:
    quant: str
    positions: int
    mean_kl: float  # nats, vs the unquantized model (0 for it)
    perplexity: float
    top1_agreement: float  # vs the unquantized model
    weight_bytes_per_forward: int


def default_text() -> tuple[str, str]:
    """(text, description) of the standard-library sample."""
    import importlib

    sources = [inspect.getsource(importlib.import_module(name)) for name in DEFAULT_MODULES]
    return "\n\n".join(sources), f"Python {sys.version.split()[0]} stdlib: {', '.join(DEFAULT_MODULES)}"


def windows(token_ids: list[int], window: int, max_tokens: int) -> list[list[int]]:
    ids = token_ids[:max_tokens]
    return [ids[start : start + window] for start in range(0, len(ids), window) if len(ids[start : start + window]) > 1]


@torch.inference_mode()
def _log_probs(model: Any, ids: list[int]) -> torch.Tensor:  # -> (T, V) float32 log-probabilities
    tokens = torch.tensor([ids], device=model.device)
    positions = torch.arange(len(ids), device=model.device)[None]
    return torch.log_softmax(model(tokens, positions).logits[0].float(), dim=-1)


def measure_quality(
    target: str | None,
    quants: tuple[str, ...],
    text: str,
    dtype: str = "auto",
    device: str = "auto",
    window: int = DEFAULT_WINDOW,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    show_progress: bool = True,
) -> list[QualityRow]:
    """One row per quantization, the unquantized model ("none") first."""
    from tqdm.auto import tqdm

    from specdecode.bench.roofline import weight_bytes_per_forward
    from specdecode.core.device import resolve_device, resolve_dtype
    from specdecode.models import demo
    from specdecode.models.loader import load_model
    from specdecode.models.quantize import check_quant

    for quant in quants:
        check_quant(quant, "quants")
    if window < 2:
        raise InvalidRequestError(f"window={window}: it must be >= 2.")
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    name = target or demo.DEFAULT_TARGET
    base = load_model(name, torch_dtype, torch_device, show_progress=show_progress)
    chunks = windows(base.tokenizer.encode(text), window, max_tokens)
    if not chunks:
        raise InvalidRequestError("The text is too short to score (it needs at least 2 tokens).")
    reference = [_log_probs(base.model, chunk) for chunk in tqdm(chunks, desc="none", disable=not show_progress)]
    rows = []
    for quant in ("none",) + tuple(q for q in quants if q != "none"):
        model = base if quant == "none" else load_model(name, torch_dtype, torch_device, show_progress=show_progress, quant=quant)
        kl = nll = agree = positions = 0.0
        for ref, chunk in zip(tqdm(reference, desc=quant, disable=not show_progress), chunks):
            logp = ref if quant == "none" else _log_probs(model.model, chunk)
            scored = len(chunk) - 1  # the last position has no next token to score
            kl += (ref.exp() * (ref - logp)).sum(-1)[:scored].sum().item()
            nll -= logp[torch.arange(scored), torch.tensor(chunk[1:])].sum().item()
            agree += (logp.argmax(-1) == ref.argmax(-1))[:scored].sum().item()
            positions += scored
        rows.append(QualityRow(
            quant=quant, positions=int(positions), mean_kl=kl / positions, perplexity=math.exp(nll / positions),
            top1_agreement=agree / positions,
            weight_bytes_per_forward=weight_bytes_per_forward(model.config, torch_dtype, quant),
        ))
        if quant != "none":
            del model
    return rows


def markdown_table(rows: list[QualityRow]) -> str:
    lines = [
        "| weights | GB per forward | mean KL to none (nats) | perplexity | top-1 agreement with none | positions |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.quant} | {row.weight_bytes_per_forward / 1e9:.2f} | {row.mean_kl:.4f} | {row.perplexity:.3f} | "
            f"{row.top1_agreement:.1%} | {row.positions} |"
        )
    return "\n".join(lines)


def write_quality(rows: list[QualityRow], description: str, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"text": description, "rows": [asdict(r) for r in rows]}, indent=2))
    return out
