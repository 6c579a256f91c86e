"""``specdecode train medusa|eagle``: train draft heads on the frozen target's own features.

1. **Features** (``training/features.py``): the training text runs through the target once; features
   and the target's top-k next-token distributions go to shards on disk (resumable).
2. **Draft vocabulary**: the ``draft_vocab`` tokens the target predicts (or reads) most often
   in the training data, then the lowest ids (BPE vocabularies put frequent merges first),
   with the end-of-sequence tokens always in. The heads' LM head is the target's rows for
   them, frozen.
3. **Training** (fp32, AdamW, a fixed seed; the last ``eval_fraction`` of the sequences are
   held apart). The loss is cross-entropy against the target's own top-k distribution
   (self-distillation; tokens outside the draft vocabulary drop out):
   - Medusa (Medusa-1: target frozen): head i on f_p against the target's distribution
     at p + i, i.e. for token p + 1 + i; head i's loss is weighted 0.8^(i-1) as in Medusa.
   - EAGLE: pairs (f_p + noise, t_{p+1}) -> predicted f_{p+1}: smooth-L1 to the real f_{p+1}
     plus ``ce_weight`` x cross-entropy of its logits against the target at p + 1 (EAGLE-1's
     weights). Gaussian noise on the input features (``noise`` x their RMS) teaches the head
     to cope with its own imperfect features when it drafts further.
   A checkpoint (trained tensors, optimizer, epoch) is written after each epoch; rerunning
   the same command resumes; it is deleted once the heads are saved (in the target's dtype).
4. **Report**: held-apart top-1 accuracy per Medusa head, or per EAGLE draft depth (the head
   fed its own predicted features, as when drafting; depth d counts only where depths
   1..d-1 were right), and the Medusa tree built from per-rank accuracies. ``heads.json``
   keeps both; ``train_report.json`` adds time and token counts.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specdecode.drafters.medusa import DEFAULT_TREE_SIZE, build_static_tree
from specdecode.errors import InvalidRequestError
from specdecode.kv.static import KVCache, KVView
from specdecode.models.heads import EagleHead, HeadConfig, MedusaHeads, new_heads, with_report
from specdecode.training.features import FeatureSequence, iter_sequences

CHECKPOINT_FILE = "checkpoint.pt"
REPORT_FILE = "train_report.json"
DEFAULT_DRAFT_VOCAB = 32768
DEFAULT_EPOCHS = {"medusa": 2, "eagle": 3}
DEFAULT_LR = {"medusa": 1e-3, "eagle": 3e-4}
DEFAULT_MEDUSA_HEADS = 4
DEFAULT_NOISE = 0.05
DEFAULT_CE_WEIGHT = 0.1
MEDUSA_HEAD_DECAY = 0.8
EVAL_RANKS = 8  # top-k ranks measured per Medusa head (the tree builder's input)
EVAL_DEPTH = 5  # EAGLE depths measured
LOSS_CHUNK = 128  # positions per LM-head chunk: bounds the (chunk, K, Vd) logits in memory


@dataclass(slots=True)
class TrainConfig:
    kind: str  # "medusa" or "eagle"
    epochs: int = 0  # 0: the kind's default
    lr: float = 0.0  # 0: the kind's default
    seed: int = 0
    num_heads: int = DEFAULT_MEDUSA_HEADS
    draft_vocab: int = DEFAULT_DRAFT_VOCAB
    eval_fraction: float = 0.1
    noise: float = DEFAULT_NOISE
    ce_weight: float = DEFAULT_CE_WEIGHT
    tree_size: int = DEFAULT_TREE_SIZE

    def __post_init__(self) -> None:
        if self.kind not in ("medusa", "eagle"):
            raise InvalidRequestError(f"the head kind must be one of medusa, eagle; got {self.kind!r}.")
        self.epochs = self.epochs or DEFAULT_EPOCHS[self.kind]
        self.lr = self.lr or DEFAULT_LR[self.kind]
        if not 0.0 < self.eval_fraction < 1.0:
            raise InvalidRequestError(f"eval_fraction={self.eval_fraction} is out of range: use (0, 1).")
        if self.num_heads < 1 or self.draft_vocab < 1 or self.epochs < 1:
            raise InvalidRequestError(
                f"num_heads={self.num_heads}, draft_vocab={self.draft_vocab} and epochs={self.epochs} must be positive."
            )


def choose_draft_vocab(
    sequences: list[FeatureSequence], size: int, vocab_size: int, always: tuple[int, ...]
) -> torch.Tensor:
    """(size,) long target ids: ``always``, then the most frequent, then the lowest unused ids."""
    size = min(size, vocab_size)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for seq in sequences:
        counts += torch.bincount(seq.top_ids[:, 0], minlength=vocab_size)
        counts += torch.bincount(seq.tokens, minlength=vocab_size)
    for token in always:
        if 0 <= token < vocab_size:
            counts[token] = counts.max() + 1
    # Stable descending sort: ties (notably the unseen, count 0) keep ascending id order.
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[:size].clone()


def _soft_ce(
    logits: torch.Tensor,  # (N, Vd) float
    top_ids: torch.Tensor,  # (N, K) long target ids
    top_probs: torch.Tensor,  # (N, K) float
    row_of: torch.Tensor,  # (V,) long: target id -> draft row, -1 outside the draft vocabulary
) -> torch.Tensor:
    """Cross-entropy against the target's top-k distribution restricted to the draft vocabulary."""
    rows = row_of[top_ids]
    weights = top_probs.float() * (rows >= 0)
    weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-9)
    logp = logits.log_softmax(-1).gather(1, rows.clamp_min(0))
    return -(weights * logp).sum(-1).mean()


def _medusa_loss(heads: MedusaHeads, seq: FeatureSequence, row_of: torch.Tensor) -> torch.Tensor:
    features = seq.features.float()
    total = features.new_zeros(())
    length = features.shape[0]
    for i in range(1, heads.config.num_heads + 1):
        if length <= i:
            break
        weight = MEDUSA_HEAD_DECAY ** (i - 1)
        for begin in range(0, length - i, LOSS_CHUNK):
            end = min(begin + LOSS_CHUNK, length - i)
            hidden = heads.blocks[i - 1](features[begin:end])
            logits = heads.draft_logits(hidden)
            share = (end - begin) / (length - i)
            total = total + weight * share * _soft_ce(
                logits, seq.top_ids[begin + i : end + i], seq.top_probs[begin + i : end + i], row_of
            )
    return total


def _eagle_loss(
    head: EagleHead, embed: torch.nn.Embedding, seq: FeatureSequence, row_of: torch.Tensor, noise: float, ce_weight: float,
    generator: torch.Generator,
) -> torch.Tensor:
    features = seq.features.float()
    inputs = features[:-1]
    if noise > 0:
        rms = inputs.pow(2).mean(-1, keepdim=True).sqrt()
        inputs = inputs + noise * rms * torch.randn(inputs.shape, generator=generator)
    tokens = seq.tokens[1:]
    positions = torch.arange(1, features.shape[0])[None]
    with torch.no_grad():
        embeds = embed(tokens[None]).float()
    predicted = head(inputs[None], embeds, positions)[0]  # (T-1, C)
    regression = F.smooth_l1_loss(predicted, features[1:])
    ce = predicted.new_zeros(())
    count = predicted.shape[0]
    for begin in range(0, count, LOSS_CHUNK):
        end = min(begin + LOSS_CHUNK, count)
        logits = head.draft_logits(predicted[begin:end])
        ce = ce + (end - begin) / count * _soft_ce(logits, seq.top_ids[begin + 1 : end + 1], seq.top_probs[begin + 1 : end + 1], row_of)
    return regression + ce_weight * ce


@torch.no_grad()
def medusa_accuracy(heads: MedusaHeads, sequences: list[FeatureSequence], ranks: int = EVAL_RANKS) -> list[list[float]]:
    """accuracy[i][r]: how often head i + 1's rank-r token is the target's greedy token."""
    hits = torch.zeros(heads.config.num_heads, ranks)
    counts = torch.zeros(heads.config.num_heads)
    draft_vocab = heads.draft_vocab.cpu()
    for seq in sequences:
        features = seq.features.float()
        for i in range(1, heads.config.num_heads + 1):
            if features.shape[0] <= i:
                continue
            logits = heads.draft_logits(heads.blocks[i - 1](features[:-i]))
            top = draft_vocab[logits.topk(ranks, dim=-1).indices]  # (T-i, R)
            hits[i - 1] += (top == seq.top_ids[i:, :1]).float().sum(0)
            counts[i - 1] += top.shape[0]
    return (hits / counts.clamp_min(1)[:, None]).tolist()


@torch.no_grad()
def eagle_depth_accuracy(
    head: EagleHead, embed: torch.nn.Embedding, sequences: list[FeatureSequence], depth: int = EVAL_DEPTH
) -> list[float]:
    """Per depth d: how often the head's greedy token is the target's, given depths 1..d-1 were.

    As when drafting, depth 1 reads the real features of the context and depths >= 2 read
    the head's own predicted feature of the previous depth (the tokens are the real ones).
    All start positions of a sequence run together: each chain's rows attend to the real
    pairs up to its start plus its own earlier rows, through the head's KV cache and a mask.
    """
    cfg = head.config
    draft_vocab = head.draft_vocab.cpu()
    right = torch.zeros(depth)
    tried = torch.zeros(depth)
    for seq in sequences:
        length = seq.tokens.shape[0]
        if length < depth + 2:
            continue
        pairs = length - 1
        cache = KVCache(1, 1, cfg.num_kv_heads, cfg.head_dim, pairs * (depth + 1), torch.float32, "cpu")
        features = seq.features.float()
        tokens = seq.tokens
        real_positions = torch.arange(1, length)[None]
        causal = torch.arange(pairs)[None, :] <= torch.arange(pairs)[:, None]
        predicted = head(features[None, :-1], embed(tokens[None, 1:]).float(), real_positions, cache,
                         KVView(pairs, causal[None, None]), contiguous_start=0)[0]
        alive = torch.ones(pairs, dtype=torch.bool)
        chain_slots: list[torch.Tensor] = []
        slot = pairs
        for d in range(1, depth + 1):
            rows = pairs - (d - 1)  # chains starting at p = 0 .. rows - 1 still have a target token
            guess = draft_vocab[head.draft_logits(predicted[:rows]).argmax(-1)]
            correct = guess == seq.top_ids[d : d + rows, 0]
            alive = alive[:rows]
            tried[d - 1] += alive.sum()
            right[d - 1] += (alive & correct).sum()
            alive = alive & correct
            if d == depth or rows - 1 < 1:
                break
            # Next depth: chain p feeds (its predicted feature, the real token t_{p+d+1}).
            rows -= 1
            own = torch.arange(slot, slot + rows)
            chain_slots = [s[:rows] for s in chain_slots] + [own]
            kv_len = slot + rows
            mask = torch.zeros(rows, kv_len, dtype=torch.bool)
            mask[:, :pairs] = causal[:rows]
            for slots in chain_slots:
                mask[torch.arange(rows), slots] = True
            positions = (torch.arange(rows) + d + 1)[None]
            step_tokens = tokens[d + 1 : d + 1 + rows]
            predicted = head(predicted[None, :rows], embed(step_tokens[None]).float(), positions, cache,
                             KVView(kv_len, mask[None, None]), contiguous_start=slot)[0]
            slot = kv_len
            alive = alive[:rows]
    return (right / tried.clamp_min(1)).tolist()


def train_heads(
    target: torch.nn.Module,  # models.llama.Transformer, frozen (features come from disk)
    target_head: torch.Tensor,  # (V, C): the target's LM head weight (dense)
    shards: list[Path],
    cfg: TrainConfig,
    out: Path,
    eos_ids: tuple[int, ...] = (),
    target_name: str = "",
    show_progress: bool = True,
) -> dict[str, Any]:
    """Train heads of ``cfg.kind`` and save them to ``out``; returns the report."""
    from tqdm.auto import tqdm

    torch.manual_seed(cfg.seed)
    sequences = list(iter_sequences(shards))
    held = max(1, round(len(sequences) * cfg.eval_fraction))
    if len(sequences) < 2:
        raise InvalidRequestError("Training needs at least two sequences (one is held apart for the report).")
    train_set, eval_set = sequences[:-held], sequences[-held:]
    vocab = choose_draft_vocab(train_set, cfg.draft_vocab, target.config.vocab_size, eos_ids)
    row_of = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    row_of[vocab] = torch.arange(vocab.shape[0])
    head_cfg = HeadConfig.for_target(cfg.kind, target.config, vocab.shape[0], cfg.num_heads, target_name)
    heads = new_heads(head_cfg).float()
    heads.init_vocab(vocab, target_head.float())
    heads.lm_head.weight.requires_grad_(False)  # the target's rows, frozen (Medusa-1, EAGLE-1)
    embed = target.embed_tokens
    trainable = [p for p in heads.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=0.0)
    steps_total = cfg.epochs * len(train_set)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / max(1, steps_total))
    start_epoch, seconds = 0, 0.0
    out.mkdir(parents=True, exist_ok=True)
    checkpoint_path = out / CHECKPOINT_FILE
    if checkpoint_path.exists():
        saved = torch.load(checkpoint_path, weights_only=False)
        if saved.get("config") == asdict(cfg) and torch.equal(saved["vocab"], vocab):
            heads.load_state_dict(saved["heads"], strict=False)
            optimizer.load_state_dict(saved["optimizer"])
            scheduler.load_state_dict(saved["scheduler"])
            start_epoch, seconds = saved["epoch"], saved["seconds"]
    generator = torch.Generator().manual_seed(cfg.seed)
    order = list(range(len(train_set)))
    losses: list[float] = []
    for epoch in range(start_epoch, cfg.epochs):
        random.Random(cfg.seed + epoch).shuffle(order)
        began = time.perf_counter()
        bar = tqdm(order, desc=f"train {cfg.kind} epoch {epoch + 1}/{cfg.epochs}", unit="seq", disable=not show_progress)
        running = 0.0
        for step, index in enumerate(bar, start=1):
            seq = train_set[index]
            if cfg.kind == "medusa":
                loss = _medusa_loss(heads, seq, row_of)
            else:
                loss = _eagle_loss(heads, embed, seq, row_of, cfg.noise, cfg.ce_weight, generator)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            scheduler.step()
            running += loss.item()
            bar.set_postfix(loss=f"{running / step:.3f}")
        losses.append(running / max(1, len(order)))
        seconds += time.perf_counter() - began
        # Trained tensors only: the frozen LM head rows are rebuilt from the target on resume.
        trained = {name: p.detach() for name, p in heads.named_parameters() if p.requires_grad}
        torch.save({"config": asdict(cfg), "vocab": vocab, "heads": trained, "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": epoch + 1, "seconds": seconds}, checkpoint_path)
    heads.eval()
    if cfg.kind == "medusa":
        per_rank = medusa_accuracy(heads, eval_set)
        accuracy = tuple(row[0] for row in per_rank)
        tree = build_static_tree(per_rank, cfg.tree_size)
    else:
        per_rank = []
        accuracy = tuple(eagle_depth_accuracy(heads, embed, eval_set))
        tree = ()
    heads.config = with_report(head_cfg, tree, accuracy, tuple(tuple(row) for row in per_rank))
    heads.save(out, dtype=target.dtype)
    checkpoint_path.unlink(missing_ok=True)  # the heads are saved: nothing left to resume
    train_tokens = sum(s.tokens.shape[0] for s in train_set)
    report = {
        "kind": cfg.kind, "config": asdict(cfg), "target": target_name,
        "train_sequences": len(train_set), "train_tokens": train_tokens,
        "eval_sequences": len(eval_set), "eval_tokens": sum(s.tokens.shape[0] for s in eval_set),
        "draft_vocab": int(vocab.shape[0]), "train_seconds": round(seconds, 1), "epoch_losses": losses,
        "accuracy": list(accuracy), "accuracy_per_rank": per_rank, "tree": [list(p) for p in tree],
    }
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return report


def dense_lm_head(loaded: Any) -> torch.Tensor:
    """(V, C) the target's LM head weight; read from its checkpoint when packing dropped it."""
    weight = loaded.model.lm_head.weight
    if weight is not None:
        return weight.detach()
    from safetensors import safe_open

    from specdecode.models.loader import _safetensors_files

    for file in _safetensors_files(loaded.folder):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for key in ("lm_head.weight", "model.embed_tokens.weight"):
                if key in handle.keys():
                    return handle.get_tensor(key)
    raise InvalidRequestError(f"No LM head weight found in {loaded.folder}.")


def train_for_target(
    target: str,
    sources: list[str],
    out: Path,
    cfg: TrainConfig,
    seq_len: int,
    max_tokens: int,
    dtype: torch.dtype,
    device: torch.device,
    show_progress: bool = True,
) -> dict[str, Any]:
    """The whole ``specdecode train`` job: load the target, extract features (resumable), train."""
    from specdecode.engine.text import eos_token_ids
    from specdecode.models.loader import load_model
    from specdecode.training.features import DEFAULT_TOP_K, FeatureSpec, extract, read_shards

    if seq_len < 16 or max_tokens < seq_len:
        raise InvalidRequestError(
            f"seq_len={seq_len} and max_tokens={max_tokens}: seq_len must be at least 16 and max_tokens at least seq_len."
        )
    loaded = load_model(target, dtype, device, show_progress=show_progress)
    tokenizer = loaded.tokenizer

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    spec = FeatureSpec(target=target, sources=tuple(sources), seq_len=seq_len, max_tokens=max_tokens, top_k=DEFAULT_TOP_K)
    began = time.perf_counter()
    features_dir = extract(loaded.model, encode, spec, out / "features", show_progress=show_progress)
    extract_seconds = time.perf_counter() - began
    eos = tuple(eos_token_ids(tokenizer, loaded.folder, loaded.config.eos_token_ids))
    report = train_heads(loaded.model, dense_lm_head(loaded), read_shards(features_dir), cfg, out, eos, target,
                         show_progress=show_progress)
    report["extract_seconds_this_run"] = round(extract_seconds, 1)
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return report
