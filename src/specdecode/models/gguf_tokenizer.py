"""Rebuild a Hugging Face ``tokenizer.json`` from a GGUF file's ``tokenizer.ggml.*`` metadata.

llama.cpp stores a byte-level BPE tokenizer (``tokenizer.ggml.model == "gpt2"``) as its token
list, merge list, token types and the *name* of its pre-tokenizer (``tokenizer.ggml.pre``);
the regex itself lives in llama.cpp's source. We map the names we know to the regexes and
normalizers of the original Hugging Face tokenizers, so the rebuilt tokenizer splits text
exactly as the model was trained to see it.

SentencePiece vocabularies (``tokenizer.ggml.model == "llama"``: Llama 2, Mistral, TinyLlama)
store pieces and scores instead of merges; we derive the merges from the scores.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gguf import TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from specdecode.errors import ModelLoadError, UnsupportedModelError

SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")
_SPM_SPACE = "\u2581"  # SentencePiece's visible space

# Split regexes of the original HF tokenizers, by llama.cpp's `tokenizer.ggml.pre` name.
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama 3 differs from Qwen2 only in grouping digits by up to three.
_LLAMA3_REGEX = _QWEN2_REGEX.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def _pre_tokenizer_spec(pre: str) -> tuple[str, bool, bool]:
    """(split regex, NFC-normalize?, ignore_merges?) for a llama.cpp pre-tokenizer name."""
    if pre == "qwen2":
        return _QWEN2_REGEX, True, False  # Qwen2's HF tokenizer normalizes to NFC
    if pre in ("llama-bpe", "llama3", "llama-v3"):
        return _LLAMA3_REGEX, False, True  # Llama 3 looks whole words up before merging
    if pre == "gpt-2":
        return _GPT2_REGEX, False, False
    raise UnsupportedModelError(
        f"The GGUF's pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; supported: "
        "qwen2, llama-bpe (Llama 3), gpt-2. Use a Hugging Face model folder for this model instead."
    )


def build_hf_tokenizer(metadata: Mapping[str, Any], source: Path) -> tuple[Tokenizer, dict[str, Any]]:
    """The ``tokenizers.Tokenizer`` and the ``tokenizer_config.json`` contents for GGUF metadata.

    ``metadata`` maps GGUF keys to their values (strings, numbers, lists); ``source`` names the
    file in error messages.
    """
    tokenizer_model = metadata.get("tokenizer.ggml.model")
    if tokenizer_model not in SUPPORTED_TOKENIZER_MODELS:
        raise UnsupportedModelError(
            f"{source}: tokenizer type {tokenizer_model!r} (tokenizer.ggml.model) is not supported; "
            f"supported: {', '.join(SUPPORTED_TOKENIZER_MODELS)} (byte-level BPE as in Qwen2 and Llama 3, "
            "SentencePiece as in Llama 2 and Mistral). Use the model's Hugging Face folder instead."
        )
    if "tokenizer.ggml.tokens" not in metadata:
        raise ModelLoadError(f"{source} has no tokenizer.ggml.tokens metadata, so its tokenizer cannot be rebuilt.")
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    token_types: list[int] = list(metadata.get("tokenizer.ggml.token_type", [TokenType.NORMAL] * len(tokens)))
    if len(token_types) != len(tokens):
        raise ModelLoadError(
            f"{source}: tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens."
        )
    if tokenizer_model == "gpt2":
        tokenizer = _byte_level_bpe(metadata, tokens, source)
    else:
        tokenizer = _sentencepiece_bpe(metadata, tokens, token_types, source)
    # Control tokens (<|im_start|>, <s>) and the unknown token are special: matched whole, never
    # merged into, and skipped by decode(skip_special_tokens=True). User-defined ones (<tool_call>)
    # are matched whole but are ordinary text. Unused padding tokens ([PAD151665]) stay plain
    # vocabulary entries that no text produces.
    special_kinds = (TokenType.CONTROL, TokenType.UNKNOWN)
    typed = list(zip(tokens, token_types))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in typed if k in special_kinds])
    user_defined = [t for t, k in typed if k == TokenType.USER_DEFINED]
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])

    def token_at(key: str) -> str | None:
        token_id = metadata.get(key)
        if token_id is None:
            return None
        if not 0 <= int(token_id) < len(tokens):
            raise ModelLoadError(f"{source}: {key} = {token_id} is outside the vocabulary of {len(tokens)} tokens.")
        return tokens[int(token_id)]

    bos_token = token_at("tokenizer.ggml.bos_token_id")
    # llama.cpp adds bos by default for SentencePiece vocabularies, not for byte-level BPE ones.
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", tokenizer_model == "llama"))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    eos_token = token_at("tokenizer.ggml.eos_token_id")
    if (add_bos and bos_token is None) or (add_eos and eos_token is None):
        raise ModelLoadError(f"{source} asks to add a bos/eos token to every prompt but does not name it.")
    tokenizer.post_processor = _post_processor(
        bos_token if add_bos else None, eos_token if add_eos else None, tokenizer
    )

    tokenizer_config: dict[str, Any] = {
        # The generic fast tokenizer uses tokenizer.json as is; a model-specific class (such
        # as Qwen2Tokenizer) could rebuild parts of it from its own defaults.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos_token,
        "eos_token": eos_token,
        "pad_token": token_at("tokenizer.ggml.padding_token_id"),
        "unk_token": token_at("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
    }
    context_length = metadata.get(f"{metadata.get('general.architecture')}.context_length")
    if context_length is not None:
        tokenizer_config["model_max_length"] = int(context_length)
    chat_template = metadata.get("tokenizer.chat_template")
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    return tokenizer, tokenizer_config


def _byte_level_bpe(metadata: Mapping[str, Any], tokens: list[str], source: Path) -> Tokenizer:
    """GPT-2-style BPE over bytes mapped to printable characters, with a named split regex."""
    if "tokenizer.ggml.merges" not in metadata:
        raise ModelLoadError(f"{source} has no tokenizer.ggml.merges metadata, so its tokenizer cannot be rebuilt.")
    regex, nfc, ignore_merges = _pre_tokenizer_spec(str(metadata.get("tokenizer.ggml.pre", "<missing>")))
    merge_pairs = []
    for merge in metadata["tokenizer.ggml.merges"]:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ModelLoadError(f"{source}: malformed merge {merge!r} in tokenizer.ggml.merges.")
        merge_pairs.append((left, right))
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    try:
        bpe = models.BPE(
            vocab=vocab, merges=merge_pairs, ignore_merges=ignore_merges, fuse_unk=False, byte_fallback=False
        )
    except Exception as err:  # tokenizers raises a bare Exception for merges of unknown tokens
        raise ModelLoadError(f"{source}: the GGUF's tokenizer vocabulary is inconsistent ({err}).") from err
    tokenizer = Tokenizer(bpe)
    if nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(
    metadata: Mapping[str, Any], tokens: list[str], token_types: list[int], source: Path
) -> Tokenizer:
    """A SentencePiece BPE vocabulary (pieces + scores, no merge list) as a tokenizers BPE model.

    SentencePiece (and llama.cpp) encode by repeatedly joining the adjacent pair of pieces whose
    union has the highest score. BPE joins the pair with the lowest merge rank, so listing every
    (left, right) split of every piece, ranked by the piece's score, gives the same result.
    Characters outside the vocabulary fall back to byte pieces <0xAB>.
    """
    if "tokenizer.ggml.scores" not in metadata:
        raise ModelLoadError(f"{source} has no tokenizer.ggml.scores metadata, so its tokenizer cannot be rebuilt.")
    scores: list[float] = list(metadata["tokenizer.ggml.scores"])
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    mergeable = {t for t, kind in zip(tokens, token_types) if kind in (TokenType.NORMAL, TokenType.USER_DEFINED)}
    merges = []
    for token_id in sorted(range(len(tokens)), key=lambda i: (-scores[i], i)):
        piece = tokens[token_id]
        if piece not in mergeable:
            continue
        splits = ((piece[:cut], piece[cut:]) for cut in range(1, len(piece)))
        merges.extend((left, right) for left, right in splits if left in mergeable and right in mergeable)
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=tokens[int(unk_id)] if unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    # SentencePiece writes spaces as U+2581 and, by default, starts the text with one. llama.cpp
    # prefixes every run of text (also after a special token, and even if it starts with a space);
    # a normalizer runs on each text run between added tokens, so Prepend does exactly that,
    # where a Metaspace pre-tokenizer would skip texts that already start with a space.
    add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend(_SPM_SPACE)] if add_space_prefix else []
    tokenizer.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", _SPM_SPACE)])
    steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _post_processor(bos_token: str | None, eos_token: str | None, tokenizer: Tokenizer) -> Any:
    """Adds bos/eos around each sequence when the GGUF asks for it; otherwise only fixes offsets."""
    if bos_token is None and eos_token is None:
        return processors.ByteLevel(trim_offsets=False)
    prefix = [f"{bos_token}:0"] if bos_token else []
    suffix = [f"{eos_token}:0"] if eos_token else []
    pair_prefix = [f"{bos_token}:1"] if bos_token else []
    pair_suffix = [f"{eos_token}:1"] if eos_token else []
    specials = [(t, tokenizer.token_to_id(t)) for t in dict.fromkeys(t for t in (bos_token, eos_token) if t)]
    return processors.TemplateProcessing(
        single=" ".join(prefix + ["$A:0"] + suffix),
        pair=" ".join(prefix + ["$A:0"] + suffix + pair_prefix + ["$B:1"] + pair_suffix),
        special_tokens=specials,
    )


def write_hf_tokenizer(metadata: Mapping[str, Any], out_dir: Path, source: Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for the GGUF's tokenizer into out_dir."""
    tokenizer, tokenizer_config = build_hf_tokenizer(metadata, source)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False))


TOKENIZER_FOLDER_VERSION = 1


def cached_tokenizer_folder(gguf_path: Path, show_progress: bool = True) -> Path:
    """A folder with only the Hugging Face tokenizer of a GGUF file, built into the cache once.

    The llama.cpp backend runs the GGUF file itself and needs no converted weights, only our
    tokenizer (chat template, stop strings, incremental detokenisation) over the same ids. The
    key covers the file's resolved path, size and modification time, as for converted models.
    """
    import hashlib
    import re
    import shutil
    import sys
    import tempfile

    from specdecode.core.paths import cache_dir
    from specdecode.models.gguf_metadata import open_gguf

    resolved = Path(gguf_path).expanduser().resolve()
    if not resolved.is_file():
        raise ModelLoadError(f"GGUF file {resolved} does not exist (or is not a file). Check the path.")
    stat = resolved.stat()
    key = f"{resolved}|{stat.st_size}|{stat.st_mtime_ns}|{TOKENIZER_FOLDER_VERSION}"
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", resolved.stem)[:80]
    folder = cache_dir() / "tokenizers" / f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (folder / "tokenizer.json").is_file():
        return folder
    if show_progress:  # parsing a 150k-token vocabulary takes seconds
        print(f"specdecode: reading the tokenizer of {resolved.name}", file=sys.stderr, flush=True)
    reader = open_gguf(resolved)
    metadata = {name: field.contents() for name, field in reader.fields.items() if name.startswith("tokenizer.")}
    folder.parent.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix=f".{folder.name}.partial-", dir=folder.parent))
    try:
        write_hf_tokenizer(metadata, work_dir, resolved)
        try:
            os.rename(work_dir, folder)
        except OSError:
            if not (folder / "tokenizer.json").is_file():  # not another process's complete folder
                raise
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    return folder
