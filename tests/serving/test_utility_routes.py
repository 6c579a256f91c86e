"""The routes editors and scripts call besides completions (issue 51, items 3 and 5):
/tokenize and /detokenize in vLLM's shapes, /apply-template and /props in llama-server's,
/infill as a completion of the FIM prompt, and the usage chunk of ``include_usage``."""

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import decoder
from server_helpers import MESSAGES, MODEL, PROMPT, client, running_server, schema_fuzz, sse_data
from tiny_models import make_tiny_hf_model
from tokenizers import AddedToken, Tokenizer

from specdecode import SamplingParams, SpecDecoder
from specdecode.serving.guard import GuardOptions
from specdecode.serving.infill import find_fim_tokens, infill_prompt
from specdecode.serving.server import ServerOptions, create_app
from specdecode.serving.worker import BatchWorker

FIM_NAMES = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>")
INFILL = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(1, 2))\n", "prompt": "return",
          "input_extra": [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}]}
GREEDY_TOKENS = 12


def post(base: str, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=60, **kwargs)


def test_tokenize_equals_the_decoders_own_encode(served) -> None:
    base, dec = served
    reply = post(base, "/tokenize", {"model": MODEL, "prompt": PROMPT, "return_token_strs": True}).json()
    assert reply["tokens"] == dec.encode(PROMPT) and reply["count"] == len(reply["tokens"])
    assert reply["max_model_len"] == 512  # the tiny model's max_position_embeddings
    assert reply["token_strs"] == dec.tokenizer.convert_ids_to_tokens(reply["tokens"])
    chat = post(base, "/tokenize", {"messages": MESSAGES}).json()  # vLLM's model is optional
    assert chat["tokens"] == dec.encode(MESSAGES, chat=True)
    bare = post(base, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()["tokens"]
    assert 0 < len(bare) < len(chat["tokens"]) and chat["tokens"][:len(bare)] == bare


def test_detokenize_round_trips_and_refuses_ids_outside_the_vocabulary(served) -> None:
    base, dec = served
    tokens = post(base, "/tokenize", {"prompt": PROMPT}).json()["tokens"]
    assert post(base, "/detokenize", {"model": MODEL, "tokens": tokens}).json() == {"prompt": PROMPT}
    for bad in ([len(dec.tokenizer)], [-1], [1, "2"], [True]):
        reply = post(base, "/detokenize", {"tokens": bad})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "tokens", (bad, reply.text)
    assert post(base, "/detokenize", {"model": "other", "tokens": tokens}).status_code == 404


def test_tokenize_refuses_text_beyond_the_context_and_needs_the_key(served, start_server) -> None:
    base, _ = served
    huge = post(base, "/tokenize", {"prompt": "x" * 400_000})  # 400k chars: far more than 512 tokens can hold
    assert huge.status_code == 400 and huge.json()["error"]["code"] == "context_length_exceeded"
    surrogate = httpx.post(base + "/tokenize", content=b'{"prompt": "\\ud800"}', timeout=60,
                           headers={"Content-Type": "application/json"})
    assert surrogate.status_code == 400, surrogate.text  # a lone surrogate: a 400, not the tokenizer's 500
    with start_server(ServerOptions(guard=GuardOptions(api_key="s3cret"))) as (keyed, _):
        for path, body in (("/tokenize", {"prompt": PROMPT}), ("/detokenize", {"tokens": [1]}),
                           ("/apply-template", {"messages": MESSAGES}), ("/infill", {"input_prefix": "x"})):
            assert post(keyed, path, body).status_code == 401, path
        assert httpx.get(keyed + "/props").status_code == 401
        authorized = post(keyed, "/tokenize", {"prompt": PROMPT}, headers={"Authorization": "Bearer s3cret"})
        assert authorized.status_code == 200


def test_props_and_apply_template_in_llama_servers_shapes(served) -> None:
    base, dec = served
    props = httpx.get(base + "/props").json()
    assert props["default_generation_settings"]["n_ctx"] == 512 and props["total_slots"] == 4
    assert props["model_path"] == MODEL  # the served name, never a path on disk
    assert props["chat_template"] == dec.tokenizer.chat_template
    rendered = post(base, "/apply-template", {"messages": MESSAGES}).json()
    assert rendered == {"prompt": dec.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)}
    assert dec.tokenizer(rendered["prompt"], add_special_tokens=False)["input_ids"] == dec.encode(MESSAGES, chat=True)
    assert post(base, "/apply-template", {"messages": []}).status_code == 400


def test_infill_without_fim_tokens_is_a_400_naming_the_model(served) -> None:
    base, _ = served
    reply = post(base, "/infill", INFILL)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "fim_not_supported" and f"model {MODEL} " in error["message"]


@pytest.fixture(scope="module")
def fim_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with five more embedding rows, and its tokenizer with Qwen2.5-Coder's FIM
    tokens as those five ids."""
    folder = make_tiny_hf_model(tmp_path_factory.mktemp("tiny_fim"), arch="qwen2", seed=0, vocab_pad=len(FIM_NAMES))
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in FIM_NAMES])
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def fim_served(fim_dir: Path) -> Iterator[tuple[str, SpecDecoder]]:
    dec = decoder(fim_dir, None, method="ngram")
    worker = BatchWorker(dec.batch_engine(max_batch=2, kv_cache_tokens=1024, cost_aware=False))
    app = create_app(dec, MODEL, worker=worker)
    try:
        with running_server(app) as base:
            yield base, dec
    finally:
        worker.close()


def test_infill_builds_llama_servers_fim_layout(fim_served) -> None:
    _, dec = fim_served
    tok = dec.tokenizer
    pre, suf, mid, repo, sep = tok.convert_tokens_to_ids(list(FIM_NAMES))

    def enc(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    extra = INFILL["input_extra"][0]
    expected = ([repo, *enc("myproject\n"), sep, *enc(extra["filename"] + "\n"), *enc(extra["text"]),
                 sep, *enc("filename\n"), pre, *enc(INFILL["input_prefix"]), *enc(INFILL["prompt"]),
                 suf, *enc(INFILL["input_suffix"]), mid])
    fim = find_fim_tokens(tok)
    files = [(extra["filename"], extra["text"])]
    built = infill_prompt(tok, fim, INFILL["input_prefix"], INFILL["input_suffix"], INFILL["prompt"], files, 511)
    assert built == expected
    # Extra files that do not fit are cut from the front; the FIM core stays whole.
    core = expected[expected.index(pre):]
    cut = infill_prompt(tok, fim, INFILL["input_prefix"], INFILL["input_suffix"], INFILL["prompt"], files, len(core) + 3)
    assert cut == expected[len(expected) - len(core) - 3:]


def test_greedy_infill_equals_a_completion_of_its_fim_prompt(fim_served) -> None:
    base, dec = fim_served
    files = [(c["filename"], c["text"]) for c in INFILL["input_extra"]]
    ids = infill_prompt(dec.tokenizer, find_fim_tokens(dec.tokenizer), INFILL["input_prefix"], INFILL["input_suffix"],
                        INFILL["prompt"], files, 511)
    completion = client(base).completions.create(model=MODEL, prompt=ids, max_tokens=GREEDY_TOKENS, temperature=0)
    expected = dec.generate(ids, SamplingParams(max_new_tokens=GREEDY_TOKENS)).text
    assert completion.choices[0].text == expected
    reply = post(base, "/infill", INFILL | {"n_predict": GREEDY_TOKENS, "temperature": 0})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["content"] == expected and body["stop"] is True
    assert body["tokens_evaluated"] == len(ids) and body["tokens_predicted"] == completion.usage.completion_tokens
    assert body["model"] == MODEL and "tau" in body["specdecode"]
    with httpx.stream("POST", base + "/infill", json=INFILL | {"n_predict": GREEDY_TOKENS, "temperature": 0,
                                                             "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        events = [json.loads(event) for event in sse_data(response.iter_lines())]
    assert all(event["stop"] is False for event in events[:-1]) and events[-1]["stop"] is True
    assert "".join(event["content"] for event in events) == expected
    assert events[-1]["tokens_predicted"] == body["tokens_predicted"]


@pytest.mark.parametrize("chat", [False, True])
def test_include_usage_sends_usage_in_a_last_chunk_without_choices(served, chat: bool) -> None:
    base, dec = served
    path, prompt = ("/v1/chat/completions", {"messages": MESSAGES}) if chat else ("/v1/completions", {"prompt": PROMPT})
    body = {"model": MODEL, **prompt, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", base + path, json=body, timeout=60) as response:
        events = sse_data(response.iter_lines())
    assert events[-1] == "[DONE]"
    last, before = json.loads(events[-2]), json.loads(events[-3])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] > 0 and "tau" in last["specdecode"]
    assert before["choices"][0]["finish_reason"] in ("stop", "length") and "usage" not in before
    # The openai client reads the same stream: every chunk but the last has a choice.
    openai_client = client(base)
    if chat:
        chunks = list(openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                                            stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
        expected = dec.generate(MESSAGES, SamplingParams(max_new_tokens=8), chat=True).text
    else:
        chunks = list(openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                                       stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks[:-1])
        expected = dec.generate(PROMPT, SamplingParams(max_new_tokens=8)).text
    assert text == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == last["usage"]["completion_tokens"]


FUZZ_EXAMPLES = 25


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/apply-template", "/infill"])
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schema_fuzz_gets_no_5xx(fim_served, path: str, mode: str) -> None:
    """Bodies generated from the app's own OpenAPI schema for each route, valid and broken: a 200
    or a 4xx with the OpenAI error body, never a 5xx (on the FIM model, so /infill decodes)."""
    base, _ = fim_served

    def few_tokens(body: object) -> object:  # a few tokens each: the fuzz is about the routes, not decoding
        if isinstance(body, dict) and path == "/infill":
            return body | {"n_predict": 2, "max_tokens": 2, "stream": False}
        return body

    statuses = schema_fuzz(base, path, mode, FUZZ_EXAMPLES, prepare=few_tokens, timeout=60)
    if mode == "positive":
        assert statuses.count(200) >= len(statuses) // 2, statuses
