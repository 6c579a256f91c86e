"""GGUF conversion, its cache, and the demo model assembly, on tiny models built in tiny_models."""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import pytest
import tiny_models
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdecode.errors import DemoModelsNotInstalledError, ModelLoadError, UnsupportedModelError
from specdecode.models import demo, gguf_loader
from specdecode.models.gguf_loader import cached_hf_folder_for_gguf, convert_gguf_to_hf

# Fixed token ids (all < TINY_VOCAB_SIZE) long enough to exercise RoPE over several positions.
PROBE_IDS = torch.tensor([[509, 5, 300, 200, 45, 67, 88, 12, 400, 3, 250, 510]])
LOGITS_ATOL = 1e-5
TOKENIZER_PROBES = [
    "def quicksort(arr):\n    return arr",
    "The quick brown fox jumps over the lazy dog 12345.",
    "  indented\n\n\ttabs and   spaces  ",
    "naïve café, 東京, emoji 🙂 and <|im_start|>user\nhi<|im_end|>",
    "<|endoftext|><|im_end|>",
    "for i in range(10): total = 1000",  # "10" is a merge: Llama 3 groups digits, Qwen2 does not
    "cafe\u0301 vs caf\u00e9",  # decomposed vs composed: Qwen2 normalizes to NFC, Llama 3 does not
]
CHAT = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Write a quicksort in Python"},
]


def _logits(folder: Path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(PROBE_IDS).logits  # (1, T, vocab)


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """Per arch: the original HF folder, its mixed-quant GGUF, and the dequantized reference."""
    root = tmp_path_factory.mktemp("gguf_models")
    built = {}
    for arch, pre in (("qwen2", "qwen2"), ("llama", "llama-bpe")):
        hf_dir = tiny_models.make_tiny_hf_model(root / f"{arch}_hf", arch=arch, tokenizer_pre=pre)
        gguf_path = root / f"{arch}.gguf"
        tiny_models.write_gguf_from_hf(hf_dir, gguf_path, tiny_models.MIXED_QUANT, reference_dir=root / f"{arch}_ref")
        built[arch] = {"hf": hf_dir, "gguf": gguf_path, "ref": root / f"{arch}_ref"}
    return built


def _rewrite_gguf(
    source: Path,
    target: Path,
    metadata: dict[str, Any] | None = None,
    tensor_data: Callable[[Any], tuple[np.ndarray, gguf.GGMLQuantizationType] | None] | None = None,
    add_metadata: Callable[[gguf.GGUFWriter], None] | None = None,
) -> None:
    """Copy a GGUF, replacing metadata values (None deletes the key), adding keys through
    ``add_metadata``, and replacing tensors where ``tensor_data`` returns new data."""
    metadata = metadata or {}
    reader = gguf.GGUFReader(source)
    arch = metadata.get("general.architecture", reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(target), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = metadata.get(name, field.contents())
        if value is None:
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub_type)
    if add_metadata:
        add_metadata(writer)
    for tensor in reader.tensors:
        replaced = tensor_data(tensor) if tensor_data else None
        data, qtype = replaced if replaced else (np.array(tensor.data), tensor.tensor_type)
        writer.add_tensor(tensor.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ------------------------------------------------------------------------------ weights


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_converted_model_matches_dequantized_reference(gguf_models: dict, arch: str, tmp_path: Path) -> None:
    paths = gguf_models[arch]
    types = {tensor.tensor_type.name for tensor in gguf.GGUFReader(paths["gguf"]).tensors}
    assert types == {"F32", "F16", "BF16", "Q8_0", "Q5_0", "Q4_K", "Q6_K"}

    folder = convert_gguf_to_hf(paths["gguf"], tmp_path / "converted", torch.float32, show_progress=False)

    config = json.loads((folder / "config.json").read_text())
    original = json.loads((paths["hf"] / "config.json").read_text())
    assert config["architectures"] == original["architectures"]
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
                "eos_token_id", "bos_token_id"):
        assert config[key] == original[key], key
    assert config["rope_theta"] == original["rope_parameters"]["rope_theta"]
    assert config["rms_norm_eps"] == pytest.approx(original["rms_norm_eps"])
    # Quantization changed the weights; the converted model must equal the dequantized ones, not the original.
    expected = _logits(paths["ref"])
    assert not torch.allclose(expected, _logits(paths["hf"]), atol=1e-3)
    torch.testing.assert_close(_logits(folder), expected, atol=LOGITS_ATOL, rtol=0)


def test_llama3_rope_factors_become_rope_scaling(tmp_path: Path) -> None:
    hf_dir = tiny_models.make_tiny_hf_model(
        tmp_path / "hf", arch="llama", rope_scaling=tiny_models.LLAMA3_ROPE_SCALING, max_position_embeddings=256
    )
    tiny_models.write_gguf_from_hf(hf_dir, tmp_path / "m.gguf", "F32")
    assert "rope_freqs.weight" in {t.name for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    folder = convert_gguf_to_hf(tmp_path / "m.gguf", tmp_path / "converted", torch.float32, show_progress=False)

    config = json.loads((folder / "config.json").read_text())
    assert config["rope_parameters"] == {**tiny_models.LLAMA3_ROPE_SCALING, "rope_theta": 10_000.0}
    # Long enough that the slow, scaled frequencies turn noticeably.
    ids = torch.arange(96).remainder(tiny_models.TINY_VOCAB_SIZE).unsqueeze(0)
    models = [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32) for d in (hf_dir, folder)]
    with torch.no_grad():
        expected, converted = (model(ids).logits for model in models)
        models[1].config.rope_parameters = {"rope_type": "default", "rope_theta": 10_000.0}
        unscaled = type(models[1])(models[1].config)
        unscaled.load_state_dict(models[1].state_dict())
        assert not torch.allclose(unscaled(ids).logits, expected, atol=1e-3)
    torch.testing.assert_close(converted, expected, atol=LOGITS_ATOL, rtol=0)


def test_unpermute_inverts_llama_cpp_row_order() -> None:
    weight = torch.arange(4 * 8 * 3, dtype=torch.float32).reshape(4 * 8, 3)  # 4 heads of dim 8
    permuted = tiny_models.permute_rows_for_ggml(weight, num_heads=4)
    assert not torch.equal(permuted, weight)
    assert torch.equal(gguf_loader.unpermute_rotary_rows(permuted, num_heads=4), weight)


def test_tied_padded_vocab_and_bf16(tmp_path: Path) -> None:
    hf_dir = tiny_models.make_tiny_hf_model(tmp_path / "hf", tie_word_embeddings=True, vocab_pad=64, seed=3)
    reference = tiny_models.write_gguf_from_hf(hf_dir, tmp_path / "m.gguf", "Q8_0", reference_dir=tmp_path / "ref")
    assert "output.weight" not in {t.name for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}

    folder = convert_gguf_to_hf(tmp_path / "m.gguf", tmp_path / "bf16", torch.bfloat16, show_progress=False)
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert config["vocab_size"] == tiny_models.TINY_VOCAB_SIZE + 64
    assert config["dtype"] == "bfloat16"
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        assert "lm_head.weight" not in handle.keys()
        for name in handle.keys():
            stored = handle.get_tensor(name)
            assert stored.dtype == torch.bfloat16
            assert torch.equal(stored, reference[name].to(torch.bfloat16)), name
    # Padding rows are tokens no text produces; the tokenizer still has all real tokens.
    assert len(AutoTokenizer.from_pretrained(folder)) == tiny_models.TINY_VOCAB_SIZE + 64


# ------------------------------------------------------------------------------ tokenizer


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tokenizer_round_trips(gguf_models: dict, arch: str, tmp_path: Path) -> None:
    folder = convert_gguf_to_hf(gguf_models[arch]["gguf"], tmp_path / "converted", torch.float32, show_progress=False)
    converted = AutoTokenizer.from_pretrained(folder)
    original = AutoTokenizer.from_pretrained(gguf_models[arch]["hf"])
    # transformers 5 may pick a model-specific class (Qwen2Tokenizer for model_type qwen2) that
    # rebuilds the normalizer and pre-tokenizer itself, so check the written tokenizer.json directly too.
    converted_raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    original_raw = Tokenizer.from_file(str(gguf_models[arch]["hf"] / "tokenizer.json"))

    for text in TOKENIZER_PROBES:
        ids = converted.encode(text)
        assert ids == original.encode(text), text
        assert converted.decode(ids) == original.decode(ids)
        assert converted_raw.encode(text).ids == original_raw.encode(text).ids, text
    for special in tiny_models.SPECIAL_TOKENS:
        assert len(converted.encode(special)) == 1
    assert converted.eos_token == tiny_models.IM_END
    assert converted.pad_token == tiny_models.ENDOFTEXT
    assert converted.decode(converted.encode("a<|im_end|>"), skip_special_tokens=True) == "a"
    rendered = converted.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert rendered == original.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")


def test_add_bos_token_prepends_bos_once(gguf_models: dict, tmp_path: Path) -> None:
    _rewrite_gguf(gguf_models["llama"]["gguf"], tmp_path / "bos.gguf", metadata={"tokenizer.ggml.add_bos_token": True})
    folder = convert_gguf_to_hf(tmp_path / "bos.gguf", tmp_path / "converted", torch.float32, show_progress=False)
    converted = AutoTokenizer.from_pretrained(folder)
    plain = AutoTokenizer.from_pretrained(gguf_models["llama"]["hf"]).encode("hello world")
    assert converted.encode("hello world") == [converted.convert_tokens_to_ids(tiny_models.ENDOFTEXT)] + plain


def _llama_cpp_spm_encode(text: str, tokens: list[str], scores: list[float], types: list[int]) -> list[int]:
    """SentencePiece BPE as llama.cpp does it, as a slow reference: prefix a space, write spaces
    as U+2581, then keep joining the adjacent pair whose union is the highest-scoring piece
    (leftmost on ties); characters outside the vocabulary become byte pieces."""
    ids = {token: i for i, token in enumerate(tokens)}
    symbols = list(tiny_models.SPM_SPACE + text.replace(" ", tiny_models.SPM_SPACE))
    while True:
        candidates = [
            (scores[ids[a + b]], -i) for i, (a, b) in enumerate(zip(symbols, symbols[1:]))
            if a + b in ids and types[ids[a + b]] == gguf.TokenType.NORMAL
        ]
        if not candidates:
            break
        i = -max(candidates)[1]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    out: list[int] = []
    for symbol in symbols:
        out.extend([ids[symbol]] if symbol in ids else [ids[f"<0x{b:02X}>"] for b in symbol.encode()])
    return out


def test_sentencepiece_vocabulary_tokenizes_like_llama_cpp(gguf_models: dict, tmp_path: Path) -> None:
    tokens, scores, types = tiny_models.make_spm_vocab()
    # Shuffle the learned pieces' scores: then score order is unrelated to length and training
    # order, so only a converter that ranks merges by score matches llama.cpp.
    learned = [i for i, token in enumerate(tokens) if types[i] == gguf.TokenType.NORMAL and len(token) > 1]
    shuffled = np.random.default_rng(0).permutation([scores[i] for i in learned])
    scores = list(scores)
    for i, score in zip(learned, shuffled):
        scores[i] = float(score)
    unk, bos, eos = (tokens.index(t) for t in (tiny_models.SPM_UNK, tiny_models.SPM_BOS, tiny_models.SPM_EOS))

    def spm_metadata(writer: gguf.GGUFWriter) -> None:
        writer.add_token_scores(scores)
        writer.add_unk_token_id(unk)

    spm_fields = {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": bos, "tokenizer.ggml.eos_token_id": eos,
        "tokenizer.ggml.merges": None, "tokenizer.ggml.pre": None, "tokenizer.ggml.padding_token_id": None,
        "tokenizer.ggml.add_bos_token": None,  # absent: llama.cpp's default for SentencePiece is to add bos
    }
    _rewrite_gguf(gguf_models["llama"]["gguf"], tmp_path / "spm.gguf", metadata=spm_fields, add_metadata=spm_metadata)
    folder = convert_gguf_to_hf(tmp_path / "spm.gguf", tmp_path / "converted", torch.float32, show_progress=False)
    converted = AutoTokenizer.from_pretrained(folder)

    # Scrambled letters make pieces compete for the same characters, where merge order matters.
    scrambled = "".join(np.random.default_rng(0).choice(list("aeinorst ()_"), size=300))
    probes = [text for text in TOKENIZER_PROBES if "<|" not in text] + [tiny_models.TRAINING_TEXT, scrambled, "x"]
    for text in probes:
        expected = [bos] + _llama_cpp_spm_encode(text, tokens, scores, types)
        assert converted.encode(text) == expected, text
        assert converted.decode(expected, skip_special_tokens=True) == text
    assert converted.encode("stop</s>")[-1] == eos
    assert converted.eos_token == tiny_models.SPM_EOS and converted.bos_token == tiny_models.SPM_BOS


# ------------------------------------------------------------------------------ cache


def test_cache_converts_once_per_file_and_dtype(
    gguf_models: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    gguf_path = tmp_path / "model.gguf"
    gguf_path.write_bytes(gguf_models["qwen2"]["gguf"].read_bytes())

    first = cached_hf_folder_for_gguf(gguf_path, torch.float32, show_progress=False)
    assert first.parent == tmp_path / "cache" / "converted"
    assert (first / "config.json").is_file() and first.name.startswith("model-float32-")

    def no_conversion(*args: Any, **kwargs: Any) -> Path:
        raise AssertionError("converted again although the cache holds this file")

    monkeypatch.setattr(gguf_loader, "convert_gguf_to_hf", no_conversion)
    assert cached_hf_folder_for_gguf(gguf_path, torch.float32, show_progress=False) == first
    with pytest.raises(AssertionError):  # another dtype is another folder
        cached_hf_folder_for_gguf(gguf_path, torch.bfloat16, show_progress=False)
    stat = gguf_path.stat()
    os.utime(gguf_path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    with pytest.raises(AssertionError):  # a modified file is converted anew
        cached_hf_folder_for_gguf(gguf_path, torch.float32, show_progress=False)
    assert not [p for p in first.parent.iterdir() if ".partial-" in p.name]


def test_convert_refuses_non_empty_output_folder(gguf_models: dict, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("user data")
    with pytest.raises(ModelLoadError, match="not empty"):
        convert_gguf_to_hf(gguf_models["qwen2"]["gguf"], tmp_path / "out", torch.float32, show_progress=False)
    assert (tmp_path / "out" / "keep.txt").read_text() == "user data"


# ------------------------------------------------------------------------------ errors


def test_missing_non_gguf_and_truncated_files_raise_model_load_error(gguf_models: dict, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        convert_gguf_to_hf(tmp_path / "absent.gguf", tmp_path / "o1", torch.float32, show_progress=False)
    (tmp_path / "notes.gguf").write_text("just some text, not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        convert_gguf_to_hf(tmp_path / "notes.gguf", tmp_path / "o2", torch.float32, show_progress=False)
    data = gguf_models["qwen2"]["gguf"].read_bytes()
    for cut in (len(data) - 1000, len(data) // 2, 200):  # in the tensors, mid-file, in the metadata
        truncated = tmp_path / f"cut{cut}.gguf"
        truncated.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match=f"cut{cut}.gguf") as error:
            convert_gguf_to_hf(truncated, tmp_path / f"o{cut}", torch.float32, show_progress=False)
        assert not isinstance(error.value, UnsupportedModelError)
        assert not (tmp_path / f"o{cut}").exists()


def test_unsupported_architecture_is_named(gguf_models: dict, tmp_path: Path) -> None:
    _rewrite_gguf(gguf_models["qwen2"]["gguf"], tmp_path / "mamba.gguf", metadata={"general.architecture": "mamba"})
    with pytest.raises(UnsupportedModelError, match="'mamba'.*llama, qwen2"):
        convert_gguf_to_hf(tmp_path / "mamba.gguf", tmp_path / "out", torch.float32, show_progress=False)


def test_unsupported_tensor_type_is_named(gguf_models: dict, tmp_path: Path) -> None:
    q8_1 = gguf.GGMLQuantizationType.Q8_1  # a real GGML type that gguf-py cannot dequantize

    def as_q8_1(tensor: Any) -> tuple[np.ndarray, gguf.GGMLQuantizationType] | None:
        if tensor.name != "blk.1.ffn_up.weight":
            return None
        rows, cols = (int(d) for d in reversed(tensor.shape.tolist()))
        byte_shape = gguf.quants.quant_shape_to_byte_shape((rows, cols), q8_1)
        return np.random.default_rng(0).integers(0, 256, size=byte_shape, dtype=np.uint8), q8_1

    _rewrite_gguf(gguf_models["qwen2"]["gguf"], tmp_path / "q81.gguf", tensor_data=as_q8_1)
    with pytest.raises(UnsupportedModelError, match="blk.1.ffn_up.weight.*Q8_1"):
        convert_gguf_to_hf(tmp_path / "q81.gguf", tmp_path / "out", torch.float32, show_progress=False)


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [("tokenizer.ggml.model", "bert", "'bert'"), ("tokenizer.ggml.pre", "deepseek-coder", "'deepseek-coder'")],
)
def test_unsupported_tokenizer_is_named(gguf_models: dict, tmp_path: Path, key: str, value: str, named: str) -> None:
    _rewrite_gguf(gguf_models["qwen2"]["gguf"], tmp_path / "tok.gguf", metadata={key: value})
    with pytest.raises(UnsupportedModelError, match=named):
        convert_gguf_to_hf(tmp_path / "tok.gguf", tmp_path / "out", torch.float32, show_progress=False)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ demo models


def _fake_demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, parts: list[bytes], sha256: str | None = None) -> str:
    """Register a demo model whose parts are tiny fake packages in tmp_path; returns its name."""
    prefix = f"fake_demo_{uuid.uuid4().hex[:8]}_part"  # fresh names: nothing cached in sys.modules
    for number, payload in enumerate(parts, start=1):
        package = tmp_path / "site" / f"{prefix}{number}"
        (package / "data").mkdir(parents=True)
        (package / "data" / "part.bin").write_bytes(payload)
        (package / "__init__.py").write_text(
            "import os\n\ndef get_part_path():\n"
            "    return os.path.join(os.path.dirname(__file__), 'data', 'part.bin')\n"
        )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    whole = b"".join(parts)
    import hashlib

    model = demo.DemoModel(
        name="fake-demo",
        hf_repo="Fake/Fake-Demo-GGUF",
        part_modules=tuple(f"{prefix}{n}" for n in range(1, len(parts) + 1)),
        pip_packages=tuple(f"fake-demo-part{n}==1.0" for n in range(1, len(parts) + 1)),
        sha256=sha256 or hashlib.sha256(whole).hexdigest(),
        size_bytes=len(whole),
    )
    monkeypatch.setitem(demo.DEMO_MODELS, model.name, model)
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    return model.name


def test_demo_assembles_parts_in_order_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parts = [bytes([n]) * (1000 + n) for n in range(1, 4)]
    name = _fake_demo(tmp_path, monkeypatch, parts)
    path = demo.demo_model_path("FAKE-DEMO", show_progress=False)
    assert path == tmp_path / "cache" / "demo" / "fake-demo.gguf"
    assert path.read_bytes() == b"".join(parts)
    # A second call must not touch the parts: remove them and it still answers.
    monkeypatch.setattr(demo, "_part_paths", lambda model: pytest.fail("reassembled"))
    assert demo.demo_model_path(name, show_progress=False) == path


def test_demo_sha256_mismatch_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = _fake_demo(tmp_path, monkeypatch, [b"abc", b"def"], sha256="0" * 64)
    with pytest.raises(ModelLoadError, match="sha256"):
        demo.demo_model_path(name, show_progress=False)
    assert list((tmp_path / "cache" / "demo").iterdir()) == []


def test_demo_missing_part_names_the_install_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = _fake_demo(tmp_path, monkeypatch, [b"abc", b"def"])
    model = demo.DEMO_MODELS[name]
    broken = demo.DemoModel(**{**{f: getattr(model, f) for f in model.__slots__},
                               "part_modules": (model.part_modules[0], "fake_demo_not_installed_part2")})
    monkeypatch.setitem(demo.DEMO_MODELS, name, broken)
    with pytest.raises(DemoModelsNotInstalledError) as error:
        demo.demo_model_path(name, show_progress=False)
    message = str(error.value)
    assert "fake-demo-part2==1.0" in message and "fake-demo-part1" not in message
    assert 'pip install "specdecode[demo]"' in message and "target=/draft=" in message


def test_demo_names() -> None:
    assert demo.DEFAULT_TARGET in demo.DEMO_MODELS and demo.DEFAULT_DRAFT in demo.DEMO_MODELS
    assert demo.is_demo_model_name("Qwen2.5-Coder-1.5B-Instruct")
    assert demo.canonical_demo_name("Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF") == "qwen2.5-coder-0.5b-instruct"
    assert demo.canonical_demo_name("qwen2.5-coder-0.5b-instruct-gguf") == "qwen2.5-coder-0.5b-instruct"
    # The non-GGUF hub id names the full-precision model, not the demo file.
    assert not demo.is_demo_model_name("Qwen/Qwen2.5-Coder-1.5B-Instruct")
    assert not demo.is_demo_model_name("./qwen2.5-coder-1.5b-instruct.gguf")
    with pytest.raises(ModelLoadError, match="not a demo model"):
        demo.demo_model_path("gpt-2")


# ------------------------------------------------------------------------------ through specdecode's loader


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_gguf_and_safetensors_loads_give_the_same_model(
    gguf_models: dict, arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """specdecode's own loader: the GGUF file (converted into the cache) and the safetensors folder
    holding the same dequantized weights give equal logits and equal greedy generations."""
    from specdecode import SamplingParams, SpecDecoder
    from specdecode.models.loader import load_model

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    paths = gguf_models[arch]
    from_gguf = load_model(str(paths["gguf"]), torch.float32, torch.device("cpu"), show_progress=False)
    from_folder = load_model(str(paths["ref"]), torch.float32, torch.device("cpu"), show_progress=False)
    assert from_gguf.config == from_folder.config or _same_shape(from_gguf.config, from_folder.config)
    ids = torch.arange(1, 21)[None]
    with torch.inference_mode():
        a = from_gguf.model(ids, torch.arange(20)[None]).logits
        b = from_folder.model(ids, torch.arange(20)[None]).logits
    torch.testing.assert_close(a, b, atol=LOGITS_ATOL, rtol=0)
    params = SamplingParams(max_new_tokens=16)
    texts = [
        SpecDecoder.from_pretrained(str(src), method="none", dtype="fp32", device="cpu", backend="torch",
                                    show_progress=False).generate("def quicksort(arr):", params)
        for src in (paths["gguf"], paths["ref"])
    ]
    assert texts[0].token_ids == texts[1].token_ids and texts[0].text == texts[1].text


def _same_shape(a: Any, b: Any) -> bool:
    # rms_norm_eps goes through float32 in GGUF; everything else must be identical.
    return dataclasses.replace(a, rms_norm_eps=b.rms_norm_eps) == b
