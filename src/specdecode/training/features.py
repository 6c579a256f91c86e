"""Training data for draft heads: text -> token sequences -> the frozen target's features, on disk.

Medusa and EAGLE heads learn from the target's own features (final hidden states) and
next-token distributions. Computing those is the expensive part (a full target pass per
token), so it happens once: sequences are run through the target and written to shards in a
folder, with a manifest; training then streams the shards, epoch after epoch. An interrupted
extraction resumes at the first missing shard, and a rerun with a larger ``--max-tokens``
keeps the shards it shares with the smaller run. A shard holds, for its sequences laid end to
end:

- ``tokens`` (n,) long, ``offsets`` (S + 1,) long: where each sequence starts and ends;
- ``features`` (n, C) in the target's dtype: f_p, the feature after reading token p;
- ``top_ids`` (n, K) long and ``top_probs`` (n, K) float16: the target's K likeliest next
  tokens at p and their probabilities (soft labels; top_ids[:, 0] is its greedy choice).

Data sources (``--data``, repeatable): ``stdlib`` (the Python standard library's own source,
which ships with every Python: code for a code model, and never a bench prompt), a ``.jsonl``
file (``{"prompt_ids": [...], "answer_ids": [...]}`` rows as ``specdecode distill`` writes
them, i.e. the target's own answers, or ``{"text": ...}`` rows), a text file, or a folder of
``.py``/``.txt``/``.md`` files.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdecode.errors import InvalidRequestError

MANIFEST_FILE = "features.json"
SHARD_PATTERN = "shard-{:05d}.pt"
DEFAULT_SEQ_LEN = 512
DEFAULT_MAX_TOKENS = 50_000
DEFAULT_TOP_K = 8
SEQUENCES_PER_SHARD = 16
TEXT_SUFFIXES = (".py", ".txt", ".md")
MIN_SEQUENCE_TOKENS = 16  # shorter sequences teach a head next to nothing


@dataclass(slots=True, frozen=True)
class FeatureSpec:
    """What a features folder was made from; a rerun with another spec starts afresh."""

    target: str
    sources: tuple[str, ...]
    seq_len: int
    max_tokens: int
    top_k: int

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def _text_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)


def stdlib_files() -> list[Path]:
    """The standard library's .py files in a fixed order (tests and site-packages left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skipped = ("site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__")
    return [p for p in sorted(root.rglob("*.py")) if not any(part in skipped for part in p.relative_to(root).parts)]


def token_sequences(
    sources: Sequence[str],
    encode: Callable[[str], list[int]],  # text -> token ids
    seq_len: int,
    max_tokens: int,
) -> Iterator[list[int]]:
    """Sequences of at most ``seq_len`` tokens, ``max_tokens`` in all, from the sources in order.

    Text is cut into ``seq_len`` chunks per file (a chunk never spans two files); token-id
    rows (prompt + answer) are kept whole up to ``seq_len``.
    """
    budget = max_tokens
    for source in sources:
        for ids in _source_token_lists(source, encode):
            for begin in range(0, len(ids), seq_len):
                chunk = ids[begin : begin + seq_len][:budget]
                if len(chunk) < MIN_SEQUENCE_TOKENS:
                    continue
                budget -= len(chunk)
                yield chunk
                if budget <= 0:
                    return


def _source_token_lists(source: str, encode: Callable[[str], list[int]]) -> Iterator[list[int]]:
    if source == "stdlib":
        for path in stdlib_files():
            yield encode(path.read_text(errors="replace"))
        return
    path = Path(source)
    if not path.exists():
        raise InvalidRequestError(f"data={source!r}: no such file or folder (or use 'stdlib').")
    if path.is_dir():
        files = _text_files(path)
        if not files:
            raise InvalidRequestError(f"data={source!r}: the folder has no {'/'.join(TEXT_SUFFIXES)} files.")
        for file in files:
            yield encode(file.read_text(errors="replace"))
    elif path.suffix == ".jsonl":
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise InvalidRequestError(f"{path}:{number} is not JSON: {err}") from err
            if "prompt_ids" in row:
                yield list(row["prompt_ids"]) + list(row.get("answer_ids", []))
            elif "text" in row:
                yield encode(row["text"])
            else:
                raise InvalidRequestError(f"{path}:{number} needs 'prompt_ids' (+ 'answer_ids') or 'text'.")
    else:
        yield encode(path.read_text(errors="replace"))


@torch.inference_mode()
def target_features(
    model: torch.nn.Module,  # models.llama.Transformer
    tokens: list[int],
    top_k: int,
) -> dict[str, torch.Tensor]:
    """One sequence through the target: features (T, C), top-k next-token ids and probabilities."""
    ids = torch.tensor([tokens], dtype=torch.long, device=model.device)
    positions = torch.arange(len(tokens), device=model.device)[None]
    out = model(ids, positions)
    probs, top_ids = out.logits[0].softmax(-1).topk(top_k, dim=-1)
    return {"features": out.hidden[0], "top_ids": top_ids, "top_probs": probs.half()}


def extract(
    model: torch.nn.Module,
    encode: Callable[[str], list[int]],
    spec: FeatureSpec,
    out: Path,
    show_progress: bool = True,
) -> Path:
    """Write the target's features for ``spec``'s data to shards under ``out`` (resumable)."""
    from tqdm.auto import tqdm

    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / MANIFEST_FILE
    manifest = {"spec": asdict(spec), "key": spec.key(), "shards": [], "tokens": 0, "complete": False}
    old = json.loads(manifest_path.read_text()) if manifest_path.exists() else None
    if old is not None and old.get("key") == spec.key():
        manifest = old
    if manifest["complete"]:
        return out
    sequences = list(token_sequences(spec.sources, encode, spec.seq_len, spec.max_tokens))
    if not sequences:
        raise InvalidRequestError("The training data gave no sequences of at least "
                                  f"{MIN_SEQUENCE_TOKENS} tokens.")
    groups = [sequences[i : i + SEQUENCES_PER_SHARD] for i in range(0, len(sequences), SEQUENCES_PER_SHARD)]
    if old is not None and old.get("key") != spec.key():
        # Another spec (more --max-tokens, say): shards holding exactly the sequences this
        # one starts with are kept, so a larger run extends a smaller one.
        manifest["shards"], manifest["tokens"] = _matching_prefix(out, old.get("shards", []), groups)
    done = len(manifest["shards"])
    total = sum(len(s) for s in sequences)
    bar = tqdm(total=total, initial=sum(len(s) for g in groups[:done] for s in g), unit="tok",
               desc="target features", disable=not show_progress)
    for index in range(done, len(groups)):
        parts = []
        for seq in groups[index]:
            parts.append(target_features(model, seq, spec.top_k))
            bar.update(len(seq))
        lengths = torch.tensor([0] + [len(s) for s in groups[index]])
        shard = {
            "tokens": torch.tensor([t for s in groups[index] for t in s], dtype=torch.long),
            "offsets": lengths.cumsum(0),
            **{name: torch.cat([p[name] for p in parts]).cpu() for name in parts[0]},
        }
        name = SHARD_PATTERN.format(index)
        torch.save(shard, out / (name + ".tmp"))
        (out / (name + ".tmp")).replace(out / name)
        manifest["shards"].append(name)
        manifest["tokens"] += int(shard["tokens"].numel())
        manifest_path.write_text(json.dumps(manifest, indent=2))
    bar.close()
    manifest["complete"] = True
    manifest_path.write_text(json.dumps(manifest, indent=2))
    return out


def _matching_prefix(out: Path, shards: list[str], groups: list[list[list[int]]]) -> tuple[list[str], int]:
    """The leading shards whose tokens equal ``groups``' (kept), and their token count; the
    rest are deleted."""
    kept: list[str] = []
    tokens = 0
    for index, name in enumerate(shards):
        path = out / name
        same = False
        if index < len(groups) and path.exists() and name == SHARD_PATTERN.format(index):
            stored = torch.load(path, weights_only=True)["tokens"]
            wanted = torch.tensor([t for seq in groups[index] for t in seq], dtype=torch.long)
            same = torch.equal(stored, wanted)
        if not same or len(kept) < index:
            path.unlink(missing_ok=True)
            continue
        kept.append(name)
        tokens += int(stored.numel())
    return kept, tokens


@dataclass(slots=True)
class FeatureSequence:
    tokens: torch.Tensor  # (T,) long
    features: torch.Tensor  # (T, C)
    top_ids: torch.Tensor  # (T, K) long
    top_probs: torch.Tensor  # (T, K) float16


def read_shards(folder: Path) -> list[Path]:
    manifest_path = folder / MANIFEST_FILE
    if not manifest_path.exists():
        raise InvalidRequestError(f"{folder} holds no extracted features ({MANIFEST_FILE} missing).")
    manifest = json.loads(manifest_path.read_text())
    if not manifest.get("complete"):
        raise InvalidRequestError(f"Feature extraction in {folder} did not finish; rerun the command to resume it.")
    return [folder / name for name in manifest["shards"]]


def iter_sequences(shards: Sequence[Path]) -> Iterator[FeatureSequence]:
    """Every sequence of the shards, in order, one shard in memory at a time."""
    for path in shards:
        shard = torch.load(path, weights_only=True)
        offsets = shard["offsets"].tolist()
        for begin, end in zip(offsets[:-1], offsets[1:]):
            yield FeatureSequence(
                shard["tokens"][begin:end], shard["features"][begin:end],
                shard["top_ids"][begin:end], shard["top_probs"][begin:end],
            )
