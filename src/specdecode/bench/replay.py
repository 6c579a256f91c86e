"""Replaying pass traces: the passes a real run made, on any device, with any weights of its shapes.

Acceptance depends on the weights and pass costs on the device, and a lent GPU machine can
receive neither the real weights nor the time to measure acceptance on them. A trace recorded
with the real pair on the CPU (``engine/trace.py``: every ``begin``/``extend``/``commit`` of the
target's and the draft model's sequences) says which passes the real run made; replaying it
issues the same calls, in the same order, at the same positions, on sequences of models with the
same shapes (random weights are as good as real ones for the cost of a dense pass). The
recorded commits force the recorded acceptance, so the replay costs what the real run's passes
would cost there. What a replay leaves out: the host work between passes (drafting lookups,
sampling, the grammar), which ``overhead_seconds`` of the real run measures on its own machine.

A verify pass (the target's, with logits) is read back to the host as the engine reads its
result: the one sync per decode step the engine makes on an asynchronous device.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

from specdecode.backends.base import SequenceModel
from specdecode.config import ModelConfig, RopeScaling
from specdecode.core.tree import TokenTree
from specdecode.engine.trace import BEGIN, COMMIT, EXTEND, KEEP, TARGET, TREE, PassEvent, PassTrace
from specdecode.models.llama import Transformer, rope_inverse_frequencies

if TYPE_CHECKING:
    from specdecode.models.loader import LoadedModel

INIT_STD = 0.02  # random weights at the usual init scale: finite activations, no subnormals
RANDOM_BLOCK_ROWS = 4096


@dataclass(slots=True)
class ReplayResult:
    seconds: float  # wall time of the whole replay (one sync at the end)
    passes: dict[str, int] = field(default_factory=dict)  # by role
    rows: dict[str, int] = field(default_factory=dict)  # rows scored, by role

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "passes": dict(self.passes), "rows": dict(self.rows)}


def model_config_dict(config: ModelConfig) -> dict[str, Any]:
    """A model's shapes as a trace file's header keeps them (``random_model`` rebuilds them)."""
    data = {f.name: getattr(config, f.name) for f in fields(config)}
    if config.rope_scaling is not None:
        data["rope_scaling"] = {f.name: getattr(config.rope_scaling, f.name) for f in fields(config.rope_scaling)}
    data["eos_token_ids"] = list(config.eos_token_ids)
    return data


def full_model_config(loaded: LoadedModel) -> ModelConfig:
    """A loaded model's every shape: on llama.cpp its config holds what llama.cpp reports (no
    MLP width or RoPE base), so the GGUF file's metadata is read for the rest."""
    if loaded.backend == "torch":
        return loaded.config
    from specdecode.models.gguf_metadata import architecture, hf_config, open_gguf

    path = loaded.model.path  # backends.llamacpp.LlamaCppModel
    reader = open_gguf(path)
    metadata = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    return ModelConfig.from_hf_dict(hf_config(metadata, architecture(metadata, path), tensors, torch.float32, path))


def model_config_from_dict(data: Mapping[str, Any]) -> ModelConfig:
    values = dict(data)
    if values.get("rope_scaling") is not None:
        values["rope_scaling"] = RopeScaling(**values["rope_scaling"])
    values["eos_token_ids"] = tuple(values.get("eos_token_ids", ()))
    return ModelConfig(**values)


@torch.no_grad()
def random_model(config: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Transformer:
    """A model of ``config``'s shapes with random weights (normal, std ``INIT_STD``; norms at
    one), in ``dtype`` on ``device``, prepared as the loader prepares real weights (tied head,
    the CPU's bf16 packing)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(config)
    state = {}
    for name, parameter in model.named_parameters():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        if "norm" in name:
            state[name] = torch.ones(parameter.shape, dtype=dtype, device=device)
        elif name.endswith("bias"):
            state[name] = torch.zeros(parameter.shape, dtype=dtype, device=device)
        else:
            tensor = torch.empty(parameter.shape, dtype=dtype, device=device)
            # Drawn in blocks of rows on the host: a 151k-row embedding needs no full fp32 copy.
            for first in range(0, tensor.shape[0], RANDOM_BLOCK_ROWS):
                block = tensor[first : first + RANDOM_BLOCK_ROWS]
                block.copy_(torch.randn(block.shape, generator=generator) * INIT_STD)
            state[name] = tensor
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.inv_freq = rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling).to(device)
    model = model.eval().requires_grad_(False)
    if device.type == "cpu":
        model.pack_weights_for_cpu()
    return model


def _tree(event: PassEvent, device: torch.device) -> TokenTree:
    nodes = event.args[1]
    parents = [-1, *event.args[2 : 2 + nodes - 1]]
    return TokenTree(parents, torch.zeros(nodes, dtype=torch.long, device=device), [False] * nodes)


@torch.inference_mode()
def replay(trace: PassTrace, sequences: Mapping[str, SequenceModel]) -> ReplayResult:
    """Issue ``trace``'s calls on ``sequences`` (by role: "target", "draft"), timed as a whole.

    Token ids are zeros: a dense pass costs the same for any ids. A role the trace uses and
    ``sequences`` lacks is an error (a draft trace needs a draft-shaped model)."""
    missing = {e.role for e in trace.events} - set(sequences)
    if missing:
        raise ValueError(f"the trace has passes of {sorted(missing)} and no sequence was given for them")
    device = sequences[TARGET].device if TARGET in sequences else next(iter(sequences.values())).device
    longest = max((e.rows for e in trace.events if e.op == EXTEND), default=1)
    zeros = torch.zeros((1, longest), dtype=torch.long, device=device)
    passes: dict[str, int] = {}
    rows: dict[str, int] = {}
    # Positions each role's sequence holds. A batch-engine trace's BEGIN keeps what its pool's
    # prefix cache served, which may be an older request's prefix than the one sequence before
    # it here; the replay keeps what it holds (a pass costs the same either way: zeros for ids).
    held: dict[str, int] = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for event in trace.events:
        sequence = sequences[event.role]
        if event.op == BEGIN:
            held[event.role] = min(event.args[1], held.get(event.role, 0))
            sequence.begin(event.args[0], keep=held[event.role])
        elif event.op == COMMIT:
            held[event.role] = event.args[0]
            sequence.commit(event.args[0])
        elif event.op == EXTEND:
            start, count, logit_rows = event.args
            out = sequence.extend(zeros[:, :count], start, logits_last=logit_rows if 0 < logit_rows < count else None,
                                  compute_logits=logit_rows > 0)
            if event.role == TARGET and logit_rows > 0 and out.logits is not None:
                out.logits[0, -1].argmax().item()  # the engine's one host read per verify step
        elif event.op == TREE:
            out = sequence.extend_tree(_tree(event, device), event.args[0])
            if out.logits is not None:
                out.logits[0, -1].argmax().item()
        elif event.op == KEEP:
            sequence.keep_path(event.args[0], list(event.args[1:]))
        if event.is_pass:
            passes[event.role] = passes.get(event.role, 0) + 1
            rows[event.role] = rows.get(event.role, 0) + event.rows
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return ReplayResult(time.perf_counter() - started, passes, rows)
