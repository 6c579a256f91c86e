"""Tiny random models for tests: a byte-level BPE tokenizer, HF models built on it, and GGUF files.

Every test in the project builds its models here, so that a failing test can be rerun from a
few lines of code and nothing is downloaded. Everything is deterministic: the tokenizer is
trained on the fixed text below, and weights come from a seeded ``torch.Generator``.

- ``make_tiny_tokenizer(out_dir)``: a Qwen-style tokenizer (ChatML template, ``<|im_end|>`` as
  eos) with ``TINY_VOCAB_SIZE`` tokens.
- ``make_tiny_hf_model(out_dir, arch=...)``: a random ``Qwen2ForCausalLM`` or ``LlamaForCausalLM``
  saved with ``save_pretrained`` plus that tokenizer.
- ``write_gguf_from_hf(hf_dir, gguf_path, quant)``: the same model as llama.cpp's converter would
  write it (metadata keys, tensor names, Llama's q/k row permutation), with chosen tensors
  quantized; returns the dequantized weights so a test can build the exact expected model.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# 256 byte tokens + 253 merges + 3 special tokens appended at the end, as Qwen orders them.
TINY_VOCAB_SIZE = 512

# Qwen2.5's chat template, shortened to the parts a test exercises (no default system): its tools
# section, its <tool_call> markup for an assistant's calls and <tool_response> for role tool, as
# the demo models' template writes them; without tools the plain ChatML turns.
CHATML_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n</tools><|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message.tool_calls %}"
    "{{ '<|im_start|>assistant' }}{% if message.content %}{{ '\\n' + message.content }}{% endif %}"
    "{% for call in message.tool_calls %}{% set call = call.function %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}{{ call.arguments | tojson }}"
    "{{ '}\\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The pre-tokenizer regexes of Qwen2 and Llama 3; llama.cpp names them by `tokenizer.ggml.pre`.
# They are written out here (not imported from specdecode) so the GGUF tests check the converter
# against an independent statement of what the tokenizer must be.
PRE_TOKENIZER_REGEX = {
    "qwen2": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
    "llama-bpe": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}

# Training text: English prose and Python, so merges cover words, indentation and code symbols.
TRAINING_TEXT = '''
Speculative decoding lets a small draft model propose several tokens, and a large target model
checks all of them in one forward pass. When the draft guesses well, the target produces many
tokens for the price of one step; when it guesses badly, nothing is lost but a little time.
The output is exactly what the target model alone would have written.

The quick brown fox jumps over the lazy dog. A model reads the prompt, writes an answer, and
stops at the end of its turn. The cache keeps the keys and values of every position so that the
next step only has to look at the newest token.

def quicksort(arr):
    """Sort a list with the quicksort algorithm."""
    if len(arr) <= 1:
        return arr
    pivot = arr[len(arr) // 2]
    left = [x for x in arr if x < pivot]
    middle = [x for x in arr if x == pivot]
    right = [x for x in arr if x > pivot]
    return quicksort(left) + middle + quicksort(right)


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def increment(self, step: int = 1) -> int:
        self.value += step
        return self.value


def fibonacci(n: int) -> list[int]:
    result = [0, 1]
    while len(result) < n:
        result.append(result[-1] + result[-2])
    return result[:n]


for i in range(10):
    print(i, fibonacci(i), quicksort([3, 1, 2]))
'''


def _train_tokenizer(pre: str) -> Tokenizer:
    if pre not in PRE_TOKENIZER_REGEX:
        raise ValueError(f"pre must be one of {sorted(PRE_TOKENIZER_REGEX)}, got {pre!r}")
    # Qwen2 normalizes to NFC; Llama 3 does not normalize and looks up whole words first.
    tokenizer = Tokenizer(models.BPE(ignore_merges=(pre == "llama-bpe")))
    if pre == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_REGEX[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE - len(SPECIAL_TOKENS),
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([TRAINING_TEXT], trainer=trainer)
    # Special tokens go last, after the merges, as in Qwen's vocabulary.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if tokenizer.get_vocab_size(with_added_tokens=True) != TINY_VOCAB_SIZE:
        raise AssertionError("the training text no longer yields enough merges for TINY_VOCAB_SIZE")
    return tokenizer


def make_tiny_tokenizer(out_dir: Path, pre: str = "qwen2", model_max_length: int = 512) -> Path:
    """Write a deterministic byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json).

    ``pre`` picks the pre-tokenizer: ``"qwen2"`` (default; NFC + Qwen2's regex) or ``"llama-bpe"``
    (Llama 3's regex, whole-word lookup). The result loads with ``AutoTokenizer.from_pretrained``;
    its eos is ``<|im_end|>`` and its pad ``<|endoftext|>``, and it has a ChatML chat template.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _train_tokenizer(pre).save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": CHATML_TEMPLATE,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return out_dir


def tokenizer_pre_name(hf_dir: Path) -> str:
    """Which ``PRE_TOKENIZER_REGEX`` entry the tokenizer in ``hf_dir`` uses (its GGUF `pre` name)."""
    spec = json.loads((Path(hf_dir) / "tokenizer.json").read_text())
    pattern = spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]
    for name, regex in PRE_TOKENIZER_REGEX.items():
        if regex == pattern:
            return name
    raise ValueError(f"{hf_dir} has a pre-tokenizer regex that tiny_models does not know")


# --------------------------------------------------------------------------------------------
# HF models
# --------------------------------------------------------------------------------------------

# Weight init. With transformers' default std 0.02 a 2-layer random model is close to a unigram
# model: greedy decoding locks onto one token within a few steps, which makes speculative
# decoding trivially "perfect". A larger std gives position- and context-dependent logits, so
# greedy continuations vary (checked: 32 greedy tokens from a short prompt use 27-30 distinct ids
# at 0.08, against 5-8 at 0.02; top-1 probabilities stay below ~0.15, so logits are not peaked).
WEIGHT_INIT_STD = 0.08
# Biases and norm gains get noise too, so a loader that drops a bias or swaps the two norms of a
# layer produces different logits instead of passing by luck (zero bias, all-ones gain).
BIAS_INIT_STD = 0.05
NORM_GAIN_NOISE_STD = 0.1
DEFAULT_ROPE_THETA = {"qwen2": 1_000_000.0, "llama": 10_000.0}
# Llama 3.1's RoPE scaling. With head_dim 64 and theta 1e4, frequencies fall in all three bands
# (kept, smoothed, divided by `factor`). transformers warns that the original context exceeds
# a tiny model's max_position_embeddings; that is harmless.
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def make_tiny_hf_model(
    out_dir: Path,
    arch: str = "qwen2",
    seed: int = 0,
    hidden_size: int = 256,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 512,
    vocab_pad: int = 0,
    rope_theta: float | None = None,
    rms_norm_eps: float = 1e-6,
    tokenizer_pre: str = "qwen2",
    rope_scaling: dict | None = None,
) -> Path:
    """Save a random-weight fp32 ``Qwen2ForCausalLM`` (q/k/v bias) or ``LlamaForCausalLM`` to out_dir.

    The vocabulary is the tiny tokenizer's (``TINY_VOCAB_SIZE``) plus ``vocab_pad`` extra
    embedding rows that no token maps to, as real checkpoints pad their vocabularies; two models
    that differ only in ``vocab_pad`` share a tokenizer. The same ``seed`` and shape arguments
    always give the same weights. ``rope_scaling`` is passed to the config as is (for example
    ``LLAMA3_ROPE_SCALING``). Returns ``out_dir``.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    out_dir = Path(out_dir)
    make_tiny_tokenizer(out_dir, pre=tokenizer_pre, model_max_length=max_position_embeddings)
    special_ids = {token: TINY_VOCAB_SIZE - len(SPECIAL_TOKENS) + i for i, token in enumerate(SPECIAL_TOKENS)}
    common = dict(
        vocab_size=TINY_VOCAB_SIZE + vocab_pad,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=rms_norm_eps,
        rope_theta=rope_theta if rope_theta is not None else DEFAULT_ROPE_THETA[arch],
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=special_ids[ENDOFTEXT],
        eos_token_id=special_ids[IM_END],
        pad_token_id=special_ids[ENDOFTEXT],
    )
    if rope_scaling is not None:
        common["rope_scaling"] = rope_scaling
    if arch == "qwen2":
        config = Qwen2Config(**common)
    elif arch == "llama":
        config = LlamaConfig(**common, attention_bias=False, mlp_bias=False)
    else:
        raise ValueError(f"arch must be 'qwen2' or 'llama', got {arch!r}")

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # Sorted names: the draw order, hence the weights, must not depend on module order.
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + NORM_GAIN_NOISE_STD * noise)
            elif name.endswith(".bias"):
                param.copy_(BIAS_INIT_STD * noise)
            else:
                param.copy_(WEIGHT_INIT_STD * noise)
    model.generation_config.eos_token_id = special_ids[IM_END]
    model.generation_config.pad_token_id = special_ids[ENDOFTEXT]
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


# --------------------------------------------------------------------------------------------
# GGUF
# --------------------------------------------------------------------------------------------

Q = gguf.GGMLQuantizationType
QK_K = 256  # elements in a K-quant super-block

# One of each tensor type the converter must read, spread over a 2-layer model. Keys are
# fnmatch patterns over GGUF tensor names; the first match wins; 1-D tensors are always F32.
MIXED_QUANT: dict[str, str] = {
    "token_embd.weight": "Q5_0",
    "output.weight": "Q6_K",
    "blk.0.attn_q.weight": "Q4_K",
    "blk.0.attn_k.weight": "Q8_0",
    "blk.0.attn_v.weight": "BF16",
    "blk.0.attn_output.weight": "F16",
    "blk.0.ffn_gate.weight": "Q6_K",
    "blk.0.ffn_up.weight": "Q5_0",
    "blk.0.ffn_down.weight": "Q4_K",
    "blk.1.attn_q.weight": "Q8_0",
    "blk.1.attn_k.weight": "Q4_K",
    "blk.1.attn_v.weight": "Q6_K",
    "blk.1.ffn_down.weight": "Q6_K",
    "*": "F32",
}

_LAYER_TENSOR_NAMES = {  # HF suffix after "model.layers.{i}." -> GGUF suffix after "blk.{i}."
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_TENSOR_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_tensor_name(hf_name: str) -> str:
    """The llama.cpp name of an HF Llama/Qwen2 tensor name."""
    if hf_name in _GLOBAL_TENSOR_NAMES:
        return _GLOBAL_TENSOR_NAMES[hf_name]
    if hf_name.startswith("model.layers."):
        layer, suffix = hf_name.removeprefix("model.layers.").split(".", 1)
        if suffix in _LAYER_TENSOR_NAMES:
            return f"blk.{layer}.{_LAYER_TENSOR_NAMES[suffix]}"
    raise KeyError(f"no GGUF name for HF tensor {hf_name!r}")


def permute_rows_for_ggml(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to Llama q/k projections (weights or biases).

    weight: (num_heads * head_dim, ...) in HF's rotate-half order, where each head's rows are
    [first halves of the rotary pairs, second halves]; GGML's RoPE wants the two members of a
    pair adjacent, so the rows of each head are interleaved.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _f16(values: np.ndarray) -> np.ndarray:  # (n_blocks,) float32 -> (n_blocks, 2) uint8
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    """Quantize (rows, cols) float32 to Q4_K blocks (rows, cols / 256 * 144) uint8.

    gguf-py implements Q4_K dequantization only. This is a plain round-to-nearest quantizer
    (no search for the best scales like llama.cpp's), enough to give valid blocks close to the
    input; tests compare against the dequantized values, not the input.
    Block layout: d (f16), dmin (f16), 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32,
    128 bytes of 4-bit quants; value = d * scale * q - dmin * min.
    """
    blocks = rows.astype(np.float32).reshape(-1, 8, 32)  # (n_blocks, sub-blocks, values)
    low = np.minimum(blocks.min(axis=-1), 0.0)  # (n_blocks, 8); mins are subtracted, so <= 0
    sub_scale = (blocks.max(axis=-1) - low) / 15
    sub_min = -low
    d = sub_scale.max(axis=-1, keepdims=True) / 63
    dmin = sub_min.max(axis=-1, keepdims=True) / 63
    # Round d and dmin to f16 first: the quants must be computed with the scales stored.
    d = d.astype(np.float16).astype(np.float32)
    dmin = dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(np.divide(sub_scale, d, out=np.zeros_like(sub_scale), where=d > 0)), 0, 63)
    mn = np.clip(np.round(np.divide(sub_min, dmin, out=np.zeros_like(sub_min), where=dmin > 0)), 0, 63)
    step = (d * sc)[..., None]
    offset = (dmin * mn)[..., None]
    q = np.clip(np.round(np.divide(blocks + offset, step, out=np.zeros_like(blocks), where=step > 0)), 0, 15)
    sc, mn, q = sc.astype(np.uint8), mn.astype(np.uint8), q.astype(np.uint8)
    scales = np.concatenate(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),  # bytes 0-3: scale j, top bits of scale j+4
            mn[:, :4] | ((mn[:, 4:] >> 4) << 6),  # bytes 4-7: min j, top bits of min j+4
            (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4),  # bytes 8-11: low bits of j+4
        ],
        axis=-1,
    )
    # Each 32-byte chunk c holds sub-block 2c in its low nibbles and 2c+1 in its high nibbles.
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(-1, 128)
    packed = np.concatenate([_f16(d), _f16(dmin), scales, qs], axis=-1)
    return packed.reshape(rows.shape[0], -1)


def quantize_q6_k(rows: np.ndarray) -> np.ndarray:
    """Quantize (rows, cols) float32 to Q6_K blocks (rows, cols / 256 * 210) uint8.

    Round-to-nearest, like ``quantize_q4_k``. Block layout: 128 bytes of low 4 bits, 64 bytes of
    high 2 bits, 16 int8 scales for sub-blocks of 16, d (f16); value = d * scale * (q - 32).
    """
    blocks = rows.astype(np.float32).reshape(-1, 16, 16)  # (n_blocks, sub-blocks, values)
    sub_scale = np.abs(blocks).max(axis=-1) / 31  # q - 32 spans [-32, 31]
    d = (sub_scale.max(axis=-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(np.divide(sub_scale, d, out=np.zeros_like(sub_scale), where=d > 0)), -128, 127)
    step = (d * sc)[..., None]
    q = np.round(np.divide(blocks, step, out=np.zeros_like(blocks), where=step > 0))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)  # two halves of 128
    # In each half: byte b's low nibble is value b, its high nibble value b + 64; the 2-bit
    # tops of values s*32 + l (s = 0..3) share byte l of the half's 32 qh bytes.
    ql = (q[:, :, :64] & 0x0F) | ((q[:, :, 64:] & 0x0F) << 4)
    tops = (q >> 4).reshape(-1, 2, 4, 32)
    qh = tops[:, :, 0] | (tops[:, :, 1] << 2) | (tops[:, :, 2] << 4) | (tops[:, :, 3] << 6)
    packed = np.concatenate(
        [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8), _f16(d)], axis=-1
    )
    return packed.reshape(rows.shape[0], -1)


def quantize_tensor(values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """values (rows, cols) float32 -> GGUF payload: float32/float16 array or uint8 blocks."""
    if qtype == Q.Q4_K:
        return quantize_q4_k(values)
    if qtype == Q.Q6_K:
        return quantize_q6_k(values)
    return gguf.quants.quantize(values, qtype)


def _quant_type_for(gguf_name: str, values: np.ndarray, quant: dict[str, str] | str) -> gguf.GGMLQuantizationType:
    if values.ndim == 1:
        return Q.F32  # llama.cpp keeps norms and biases in F32
    if isinstance(quant, str):
        return Q[quant]
    for pattern, type_name in quant.items():
        if fnmatch.fnmatchcase(gguf_name, pattern):
            return Q[type_name]
    return Q.F32


def write_gguf_from_hf(
    hf_dir: Path,
    gguf_path: Path,
    quant: dict[str, str] | str = "F32",
    reference_dir: Path | None = None,
    architecture: str | None = None,
) -> dict[str, torch.Tensor]:
    """Write the tiny HF model in ``hf_dir`` as a GGUF file, the way llama.cpp's converter does.

    ``quant`` is a GGML type name for every 2-D tensor ("F32", "F16", "BF16", "Q8_0", "Q5_0",
    "Q4_K", "Q6_K", ...) or a dict of fnmatch patterns over GGUF tensor names to type names
    (first match wins, unmatched tensors F32; see ``MIXED_QUANT``). 1-D tensors are F32.

    Returns the HF-named float32 weights as the GGUF holds them (dequantized, and in HF row
    order). If ``reference_dir`` is given, also writes there a copy of the HF folder whose
    weights are those values: the model a correct converter must reproduce exactly.
    ``architecture`` overrides ``general.architecture`` (to write deliberately unsupported files).
    """
    hf_dir, gguf_path = Path(hf_dir), Path(gguf_path)
    config = json.loads((hf_dir / "config.json").read_text())
    arch = config["model_type"]
    state = load_file(str(hf_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(str(gguf_path), architecture or arch)

    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10_000.0)))
    if arch == "llama":
        writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    _add_tokenizer_metadata(writer, hf_dir, config["vocab_size"])
    if rope.get("rope_type") == "llama3":
        head_dim = config["hidden_size"] // config["num_attention_heads"]
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, head_dim))

    reference: dict[str, torch.Tensor] = {}
    for hf_name in sorted(state):
        weight = state[hf_name].to(torch.float32)
        name = gguf_tensor_name(hf_name)
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = config["num_attention_heads"] if ".attn_q." in name else config["num_key_value_heads"]
            weight = permute_rows_for_ggml(weight, heads)
        values = weight.numpy()
        qtype = _quant_type_for(name, values, quant)
        payload = quantize_tensor(values, qtype)
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(name, payload)
        else:
            writer.add_tensor(name, payload, raw_dtype=qtype)
        stored = torch.from_numpy(np.array(gguf.quants.dequantize(payload, qtype), dtype=np.float32))
        stored = stored.reshape(weight.shape)
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            stored = _unpermute_rows(stored, heads)
        reference[hf_name] = stored

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    if reference_dir is not None:
        _write_reference_folder(hf_dir, Path(reference_dir), reference)
    return reference


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """(head_dim / 2,) float32: what llama.cpp stores as rope_freqs.weight for Llama 3.1 scaling,
    the number each RoPE inverse frequency is divided by."""
    inv_freq = rope["rope_theta"] ** (-np.arange(0, head_dim, 2) / head_dim)
    wavelength = 2 * np.pi / inv_freq
    original = rope["original_max_position_embeddings"]
    factors = []
    for wl in wavelength:
        if wl < original / rope["high_freq_factor"]:
            factors.append(1.0)
        elif wl > original / rope["low_freq_factor"]:
            factors.append(rope["factor"])
        else:
            smooth = (original / wl - rope["low_freq_factor"]) / (rope["high_freq_factor"] - rope["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def _unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _add_tokenizer_metadata(writer: gguf.GGUFWriter, hf_dir: Path, vocab_size: int) -> None:
    spec = json.loads((hf_dir / "tokenizer.json").read_text())
    tokenizer_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab: dict[str, int] = dict(spec["model"]["vocab"])
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    vocab.update({t["content"]: t["id"] for t in spec["added_tokens"]})
    by_id = {token_id: token for token, token_id in vocab.items()}
    tokens, types = [], []
    for token_id in range(vocab_size):
        if token_id in by_id:
            tokens.append(by_id[token_id])
            types.append(gguf.TokenType.CONTROL if by_id[token_id] in special else gguf.TokenType.NORMAL)
        else:  # embedding rows beyond the tokenizer, named as llama.cpp names them
            tokens.append(f"[PAD{token_id}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tokenizer_pre_name(hf_dir))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[ENDOFTEXT])
    writer.add_eos_token_id(vocab[tokenizer_config["eos_token"]])
    writer.add_pad_token_id(vocab[tokenizer_config["pad_token"]])
    writer.add_add_bos_token(bool(tokenizer_config.get("add_bos_token", False)))
    writer.add_chat_template(tokenizer_config["chat_template"])


def _write_reference_folder(hf_dir: Path, reference_dir: Path, weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    shutil.copytree(hf_dir, reference_dir, dirs_exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(reference_dir / "model.safetensors"),
              metadata={"format": "pt"})


# --------------------------------------------------------------------------------------------
# SentencePiece-style vocabulary (Llama 2 / Mistral GGUFs)
# --------------------------------------------------------------------------------------------

SPM_SPACE = "\u2581"  # SentencePiece's visible space
SPM_UNK, SPM_BOS, SPM_EOS = "<unk>", "<s>", "</s>"


def make_spm_vocab(num_merges: int = 150) -> tuple[list[str], list[float], list[int]]:
    """A tiny SentencePiece-BPE vocabulary as a GGUF stores it: (tokens, scores, token types).

    Laid out like Llama 2's: <unk>, <s>, </s>, the 256 byte pieces <0x00>..<0xFF>, then pieces
    learned by plain BPE on TRAINING_TEXT (score = minus the merge step, so earlier merges win),
    then the single characters (lowest scores). Deterministic.
    """
    words = [SPM_SPACE + word for word in TRAINING_TEXT.split()]  # SentencePiece marks word starts
    symbols = [list(word) for word in words]
    learned: list[str] = []
    for _ in range(num_merges):
        pair_counts: dict[tuple[str, str], int] = {}
        for word in symbols:
            for pair in zip(word, word[1:]):
                pair_counts[pair] = pair_counts.get(pair, 0) + 1
        if not pair_counts:
            break
        best = max(sorted(pair_counts), key=lambda pair: pair_counts[pair])  # ties: first in sort order
        learned.append(best[0] + best[1])
        for word in symbols:
            i = 0
            while i < len(word) - 1:
                if (word[i], word[i + 1]) == best:
                    word[i : i + 2] = [best[0] + best[1]]
                i += 1
    chars = sorted({char for word in words for char in word})
    tokens = [SPM_UNK, SPM_BOS, SPM_EOS] + [f"<0x{byte:02X}>" for byte in range(256)] + learned + chars
    scores = [0.0] * (3 + 256) + [-float(step) for step in range(len(learned))]
    scores += [-1e4 - i for i in range(len(chars))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    types += [gguf.TokenType.NORMAL] * (len(learned) + len(chars))
    return tokens, scores, [int(t) for t in types]


def write_tiny_qwen3_gguf(tokenizer_dir: Path, path: Path, seed: int = 0) -> None:
    """A random 2-layer Qwen3 (q/k RMSNorm per head, no biases) with the tiny tokenizer."""
    hidden, layers, heads, kv_heads, head_dim, ffn = 128, 2, 4, 2, 32, 256
    vocab = TINY_VOCAB_SIZE
    rng = np.random.default_rng(seed)

    def weight(*shape: int) -> np.ndarray:
        return (WEIGHT_INIT_STD * rng.standard_normal(shape)).astype(np.float32)

    def gain(size: int) -> np.ndarray:
        return (1.0 + NORM_GAIN_NOISE_STD * rng.standard_normal(size)).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_name("tiny-qwen3")
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1_000_000.0)
    _add_tokenizer_metadata(writer, tokenizer_dir, vocab)
    writer.add_tensor("token_embd.weight", weight(vocab, hidden))
    writer.add_tensor("output_norm.weight", gain(hidden))
    writer.add_tensor("output.weight", weight(vocab, hidden))
    for layer in range(layers):
        prefix = f"blk.{layer}."
        writer.add_tensor(prefix + "attn_norm.weight", gain(hidden))
        writer.add_tensor(prefix + "attn_q.weight", weight(heads * head_dim, hidden))
        writer.add_tensor(prefix + "attn_k.weight", weight(kv_heads * head_dim, hidden))
        writer.add_tensor(prefix + "attn_v.weight", weight(kv_heads * head_dim, hidden))
        writer.add_tensor(prefix + "attn_q_norm.weight", gain(head_dim))
        writer.add_tensor(prefix + "attn_k_norm.weight", gain(head_dim))
        writer.add_tensor(prefix + "attn_output.weight", weight(hidden, heads * head_dim))
        writer.add_tensor(prefix + "ffn_norm.weight", gain(hidden))
        writer.add_tensor(prefix + "ffn_gate.weight", weight(ffn, hidden))
        writer.add_tensor(prefix + "ffn_up.weight", weight(ffn, hidden))
        writer.add_tensor(prefix + "ffn_down.weight", weight(hidden, ffn))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
