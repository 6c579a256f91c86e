"""Distil the draft model towards the target: ``specdecode distill``.

A draft is only as useful as how often the target accepts its tokens, so it is fine-tuned on
what the target itself writes:

1. **Data.** The target (speculating with the draft it is about to improve: lossless, so the
   text is the target's own greedy output) answers each training prompt; prompt and answer
   token ids go to ``data.jsonl`` in the output folder, one line per prompt, appended as they
   are made, so an interrupted run resumes where it stopped.
2. **Training.** Only the draft's top ``train_layers`` decoder layers and its final norm
   train (in fp32); everything below is frozen, and so are the embedding and the LM head (the
   demo draft ties them). The frozen layers' output for every sequence is computed once and
   kept, so an epoch costs only the top layers and the head. The loss (``kl``, the default)
   is the cross-entropy of the draft against the target's own next-token distribution at
   every answer position (its top ``teacher_top_k`` probabilities, renormalised, computed
   once per sequence): KL(p_target || q_draft) up to the target's constant entropy. Soft
   targets carry far more than the one greedy token per position, which matters with a few
   thousand tokens of data; ``ce`` (cross-entropy on the answer tokens) is the alternative.
   The prompt is context only. AdamW, one sequence per step, gradients accumulated over
   ``accumulate`` sequences, a fixed seed.
   A checkpoint (trained tensors, optimizer state, step) is written after every epoch to
   ``checkpoint.pt``; rerunning the same command resumes from it.
3. **Output.** A complete Hugging Face-format model folder (``config.json``, tokenizer files,
   ``model.safetensors`` with the trained tensors in place), loadable as ``--draft FOLDER``.

Why top layers rather than LoRA: no extra dependency, no adapter to merge, the same memory
on this CPU (the 0.5B draft in fp32 is 2 GB; training its top 4 layers adds ~0.7 GB of
optimizer state), and the saved draft runs at exactly the speed of the original.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specdecode.config import SamplingParams
from specdecode.errors import InvalidRequestError
from specdecode.models.llama import component_names
from specdecode.models.loader import load_weights, read_model_config

DATA_FILE = "data.jsonl"
CHECKPOINT_FILE = "checkpoint.pt"
WEIGHTS_FILE = "model.safetensors"
# Files copied from the base draft's folder next to the trained weights.
FOLDER_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "vocab.json", "merges.txt")
DEFAULT_TRAIN_LAYERS = 4
DEFAULT_EPOCHS = 2
DEFAULT_LR = 5e-5
DEFAULT_ACCUMULATE = 4
DEFAULT_MAX_NEW_TOKENS = 128
LOSSES = ("kl", "ce")
DEFAULT_TEACHER_TOP_K = 64


@dataclass(slots=True)
class DistillConfig:
    out: Path
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    train_layers: int = DEFAULT_TRAIN_LAYERS
    epochs: int = DEFAULT_EPOCHS
    lr: float = DEFAULT_LR
    accumulate: int = DEFAULT_ACCUMULATE
    warmup_steps: int = 0  # optimizer steps over which the learning rate rises linearly to lr
    seed: int = 0
    # kl: match the target's next-token distribution (its top ``teacher_top_k`` probabilities,
    # renormalised) at every answer position; ce: cross-entropy on the answer tokens only.
    loss: str = "kl"
    teacher_top_k: int = DEFAULT_TEACHER_TOP_K
    show_progress: bool = True

    def __post_init__(self) -> None:
        if self.train_layers < 1:
            raise InvalidRequestError(f"train_layers={self.train_layers}: it must be >= 1.")
        if self.warmup_steps < 0:
            raise InvalidRequestError(f"warmup_steps={self.warmup_steps}: it must be >= 0.")
        if self.epochs < 1 or self.accumulate < 1 or self.max_new_tokens < 1:
            raise InvalidRequestError(
                f"epochs={self.epochs}, accumulate={self.accumulate} and max_new_tokens={self.max_new_tokens} "
                "must all be >= 1."
            )
        if not (0 < self.lr < 1):
            raise InvalidRequestError(f"lr={self.lr} is out of range: use (0, 1).")
        if self.loss not in LOSSES:
            raise InvalidRequestError(f"loss={self.loss!r} is not one of: {', '.join(LOSSES)}.")
        if self.teacher_top_k < 1:
            raise InvalidRequestError(f"teacher_top_k={self.teacher_top_k}: it must be >= 1.")


def held_apart_prompts(start: int, count: int) -> list[str]:
    """First-turn prompts ``start .. start + count - 1`` of each default category's fixed order.

    The bench takes the first N of each category (3 by default), so rows from 10 on are apart
    from any bench subset of up to 10 per category.
    """
    from specdecode.prompt_sets import first_turns_per_category

    return first_turns_per_category(slice(start, start + count))


def make_data(
    decoder: Any,  # api.SpecDecoder with the target and the base draft
    prompts: Sequence[str],
    path: Path,
    max_new_tokens: int,
    chat: bool,
    show_progress: bool = True,
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target answer ids) per prompt, made once and kept in ``path`` (resumable)."""
    from tqdm.auto import tqdm

    done: list[tuple[list[int], list[int]]] = []
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                done.append((row["prompt_ids"], row["answer_ids"]))
    if len(done) > len(prompts):
        raise InvalidRequestError(f"{path} holds more sequences ({len(done)}) than there are prompts ({len(prompts)}).")
    params = SamplingParams(max_new_tokens=max_new_tokens)
    with path.open("a") as handle:
        for text in tqdm(prompts[len(done) :], desc="target answers", unit="prompt", disable=not show_progress,
                         initial=len(done), total=len(prompts)):
            prompt_ids = decoder.encode(text, chat=chat)
            answer = decoder.generate(prompt_ids, params, method="draft").token_ids
            handle.write(json.dumps({"prompt_ids": prompt_ids, "answer_ids": answer}) + "\n")
            handle.flush()
            done.append((prompt_ids, answer))
    return done


def _trainable_names(num_layers: int, train_layers: int) -> list[str]:
    first = num_layers - train_layers
    return [f"layers.{i}." for i in range(first, num_layers)] + ["norm."]


@torch.no_grad()  # not inference_mode: the results enter the autograd graph of the loss
def teacher_targets(
    target: Any, sequences: Sequence[tuple[list[int], list[int]]], top_k: int, show_progress: bool = False
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence, the target's top-k next-token probabilities (renormalised) and their ids at
    each answer position: two (A, top_k) tensors, float32 and long, on the CPU."""
    from tqdm.auto import tqdm

    targets = []
    for prompt_ids, answer_ids in tqdm(sequences, desc="target distributions", disable=not show_progress):
        ids = torch.tensor([prompt_ids + answer_ids], device=target.device)
        logits = target(ids, torch.arange(ids.shape[1], device=target.device)[None]).logits[0]
        probs, index = torch.softmax(logits[len(prompt_ids) - 1 : -1].float(), dim=-1).topk(top_k, dim=-1)
        targets.append(((probs / probs.sum(dim=-1, keepdim=True)).cpu(), index.cpu()))
    return targets


def _loss(
    logits: torch.Tensor,  # (A, V_draft) draft logits at the answer positions
    answer_ids: list[int],
    teacher: tuple[torch.Tensor, torch.Tensor] | None,  # (A, top_k) probabilities and ids
) -> torch.Tensor:
    """Summed over answer positions: KL(teacher top-k || draft) in nats, or hard cross-entropy."""
    if teacher is None:
        return F.cross_entropy(logits, torch.tensor(answer_ids), reduction="sum")
    probs, index = teacher
    log_q = torch.log_softmax(logits.float(), dim=-1).gather(1, index.clamp(max=logits.shape[-1] - 1))
    return (probs * (probs.clamp_min(1e-12).log() - log_q)).sum()


def train_draft(
    draft_folder: Path,
    data: Sequence[tuple[list[int], list[int]]],
    config: DistillConfig,
    log: Callable[[str], None] = print,
    target: Any = None,
) -> dict[str, Any]:
    """Fine-tune the top layers of the draft in ``draft_folder`` on ``data``; write the model
    folder to ``config.out``. ``target`` (a loaded ``Transformer``) is needed for the kl loss.
    Returns training figures (losses, seconds)."""
    from tqdm.auto import tqdm

    cfg = read_model_config(draft_folder)
    if config.train_layers > cfg.num_layers:
        raise InvalidRequestError(f"train_layers={config.train_layers} exceeds the draft's {cfg.num_layers} layers.")
    sequences = [(p, a) for p, a in data if a]
    if not sequences:
        raise InvalidRequestError("No training sequences: every target answer was empty.")
    if config.loss == "kl" and target is None:
        raise InvalidRequestError("The kl loss needs the target model's distributions; pass target=.")
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    teachers = teacher_targets(target, sequences, config.teacher_top_k, config.show_progress) if config.loss == "kl" else None
    model = load_weights(draft_folder, cfg, torch.float32, torch.device("cpu"), pack=False)
    prefixes = _trainable_names(cfg.num_layers, config.train_layers)
    trainable = {n: p for n, p in model.named_parameters() if n.startswith(tuple(prefixes))}
    for param in trainable.values():
        param.requires_grad_(True)
    optimizer = torch.optim.AdamW(list(trainable.values()), lr=config.lr, weight_decay=0.0)
    # Adam's first steps are normalised, so without a warm-up they move a draft that already
    # matches the target by a full learning rate in every weight, whatever the gradient says.
    warmup = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / config.warmup_steps) if config.warmup_steps else 1.0
    )
    first_trained = cfg.num_layers - config.train_layers

    # The frozen layers' output, once per sequence.
    features: list[torch.Tensor] = []
    with torch.inference_mode():
        for prompt_ids, answer_ids in tqdm(sequences, desc="frozen features", disable=not config.show_progress):
            ids = torch.tensor([prompt_ids + answer_ids])
            positions = torch.arange(ids.shape[1])[None]
            hidden, _ = model.run_layers(model.embed_tokens(ids), positions, layers=range(first_trained))
            features.append(hidden.clone())

    def sequence_loss(index: int) -> tuple[torch.Tensor, int]:
        prompt_ids, answer_ids = sequences[index]
        x = features[index]
        positions = torch.arange(x.shape[1])[None]
        hidden, _ = model.run_layers(x, positions, layers=range(first_trained, cfg.num_layers))
        # Logits at positions P - 1 .. T - 2 predict the answer tokens P .. T - 1.
        logits = model.lm_head(model.norm(hidden[0, len(prompt_ids) - 1 : -1]))  # (A, V)
        return _loss(logits, answer_ids, teachers[index] if teachers else None), len(answer_ids)

    with torch.inference_mode():
        before = [sequence_loss(i) for i in range(len(sequences))]
    loss_before = sum(float(loss) for loss, _ in before) / sum(n for _, n in before)
    log(f"{config.loss} loss before training: {loss_before:.4f}")

    checkpoint_path = config.out / CHECKPOINT_FILE
    start_epoch, history = 0, []
    if checkpoint_path.exists():
        state = torch.load(checkpoint_path, weights_only=False)
        with torch.no_grad():
            for name, tensor in state["trained"].items():
                trainable[name].copy_(tensor)
        optimizer.load_state_dict(state["optimizer"])
        warmup.load_state_dict(state["warmup"])
        start_epoch, history = state["epoch"], state["history"]
        log(f"resuming after epoch {start_epoch} from {checkpoint_path}")

    started = time.perf_counter()
    model.train()
    for epoch in range(start_epoch, config.epochs):
        order = list(range(len(sequences)))
        rng.shuffle(order)
        total_loss = total_tokens = 0.0
        bar = tqdm(order, desc=f"epoch {epoch + 1}/{config.epochs}", disable=not config.show_progress)
        for step, index in enumerate(bar):
            loss, answer_len = sequence_loss(index)
            (loss / (answer_len * config.accumulate)).backward()
            if (step + 1) % config.accumulate == 0 or step + 1 == len(order):
                optimizer.step()
                warmup.step()
                optimizer.zero_grad(set_to_none=True)
            total_loss += float(loss.detach())
            total_tokens += answer_len
            bar.set_postfix(loss=f"{total_loss / total_tokens:.3f}")
        history.append({"epoch": epoch + 1, "train_loss": total_loss / total_tokens, "tokens": int(total_tokens)})
        log(f"epoch {epoch + 1}: {config.loss} loss {total_loss / total_tokens:.4f} over {int(total_tokens)} answer tokens")
        config.out.mkdir(parents=True, exist_ok=True)
        torch.save(
            {"trained": {n: p.detach().clone() for n, p in trainable.items()}, "optimizer": optimizer.state_dict(),
             "warmup": warmup.state_dict(), "epoch": epoch + 1, "history": history},
            checkpoint_path.with_suffix(".tmp"),
        )
        checkpoint_path.with_suffix(".tmp").replace(checkpoint_path)
    model.eval()
    write_model_folder(draft_folder, config.out, {n: p.detach() for n, p in trainable.items()})
    return {"loss": config.loss, "loss_before": loss_before, "history": history, "train_seconds": round(time.perf_counter() - started, 1),
            "sequences": len(sequences), "trained_layers": list(range(first_trained, cfg.num_layers)),
            "trained_parameters": sum(p.numel() for p in trainable.values())}


def write_model_folder(base: Path, out: Path, trained: dict[str, torch.Tensor]) -> None:
    """The base model folder's files with ``trained`` (our parameter names) written over its weights."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for name in FOLDER_FILES:
        if (base / name).exists():
            shutil.copy2(base / name, out / name)
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(base.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for key in handle.keys():
                tensors[key] = handle.get_tensor(key)
    prefix = "model." if any(k.startswith("model.") for k in tensors) else ""
    for name, tensor in trained.items():
        parts = component_names(name) or (name,)
        keys = [prefix + part for part in parts]
        missing = [k for k in keys if k not in tensors]
        if missing:
            raise InvalidRequestError(f"The base draft in {base} has no {missing[0]}; cannot write the trained {name}.")
        sizes = [tensors[k].shape[0] for k in keys]
        for key, piece in zip(keys, torch.split(tensor, sizes, dim=0)):
            tensors[key] = piece.to(tensors[key].dtype).contiguous()
    tmp = out / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / WEIGHTS_FILE)


@dataclass(slots=True)
class AcceptanceReport:
    """Pooled greedy draft-method figures over some prompts."""

    prompts: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens emitted by verify steps (bonus tokens counted)
    steps: int = 0
    new_tokens: int = 0
    seconds: float = 0.0

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def tau(self) -> float | None:
        return self.emitted / self.steps if self.steps else None

    @property
    def tokens_per_second(self) -> float | None:
        return self.new_tokens / self.seconds if self.seconds else None

    def add(self, stats: Any) -> None:
        """Pool one generation's ``GenerationStats``."""
        self.prompts += 1
        self.proposed += stats.draft_tokens_proposed
        self.accepted += stats.draft_tokens_accepted
        self.emitted += stats.emitted_by_steps
        self.steps += stats.verify_steps
        self.new_tokens += stats.new_tokens
        self.seconds += stats.total_seconds

    def to_dict(self) -> dict[str, Any]:
        rounded = {"acceptance": self.acceptance, "tau": self.tau, "tokens_per_second": self.tokens_per_second}
        return {"prompts": self.prompts, "proposed": self.proposed, "accepted": self.accepted,
                **{k: round(v, 4) if v is not None else None for k, v in rounded.items()}}


def compare_drafts(
    decoders: dict[str, Any], prompts: Sequence[str], chat: bool, max_new_tokens: int, k: int = 5,
    show_progress: bool = False,
) -> dict[str, AcceptanceReport]:
    """Greedy draft-method figures of each decoder's draft on ``prompts``, interleaved per prompt so
    every draft sees the same machine state."""
    from tqdm.auto import tqdm

    reports = {name: AcceptanceReport() for name in decoders}
    params = SamplingParams(max_new_tokens=max_new_tokens)
    for text in tqdm(prompts, desc="held-apart prompts", unit="prompt", disable=not show_progress):
        for name, decoder in decoders.items():
            reports[name].add(decoder.generate(decoder.encode(text, chat=chat), params, method="draft", k=k).stats)
    return reports


def write_report(out: Path, report: dict[str, Any]) -> None:
    (out / "distill_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2), file=sys.stderr)
