"""Structured outputs through the server, with the official openai client: `response_format`
(json_object, json_schema with strict) and vLLM's `structured_outputs` extension (regex, choice,
json, grammar), streamed and not, batched (none, ngram, draft) and one at a time (suffix); the
text is what the library gives for the same constraint, and it validates; bad specs are 400s
before any decoding (streams too); output cut by max_tokens says finish_reason "length"."""

import json

import jsonschema
import pytest
from server_helpers import MESSAGES, MODEL, PROMPT, client

from specdecode import SamplingParams
from specdecode.config import StructuredOutput

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"], "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}


def completion_text(base: str, stream: bool, **extra) -> tuple[str, str]:
    """(text, finish_reason) of a greedy completion of PROMPT."""
    reply = client(base).completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stream=stream,
                                            extra_body=extra)
    if not stream:
        return reply.choices[0].text, reply.choices[0].finish_reason
    text, finish = "", None
    for chunk in reply:
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    return text, finish


@pytest.mark.parametrize("method", ["none", "ngram", "draft", "suffix"])
def test_json_schema_through_the_server_equals_the_library(served, method: str) -> None:
    base, dec = served
    expected = dec.generate(PROMPT, SamplingParams(max_new_tokens=40, structured=StructuredOutput(json_schema=SCHEMA)),
                            method="none").text
    for stream in (False, True):
        text, finish = completion_text(base, stream, method=method, response_format=RESPONSE_FORMAT)
        assert text == expected
        if finish == "stop":
            jsonschema.validate(json.loads(text), SCHEMA)


def test_chat_with_a_schema_and_the_extension_forms(served) -> None:
    base, dec = served
    reply = client(base).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0,
                                                 response_format=RESPONSE_FORMAT)
    expected = dec.generate(MESSAGES, SamplingParams(max_new_tokens=60,
                                                     structured=StructuredOutput(json_schema=SCHEMA)), chat=True)
    assert reply.choices[0].message.content == expected.text
    for extension, check in (({"regex": "(cat|dog)s? [0-9]{2}"}, lambda t: t.split(" ")[0] in ("cat", "dog", "cats",
                                                                                                  "dogs")),
                             ({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
                             ({"grammar": 'root ::= "a" ("b" | "c")*'}, lambda t: t.startswith("a")),
                             ({"json": SCHEMA, "disable_any_whitespace": True}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None)):
        text, finish = completion_text(base, False, structured_outputs=extension)
        assert finish in ("stop", "length")
        assert check(text), (extension, text)


def test_json_object_cut_by_max_tokens_says_length(served) -> None:
    base, _ = served
    reply = client(base).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0,
                                                 response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content.lstrip().startswith("{")


def test_sampled_structured_requests_in_one_batch_all_validate(served) -> None:
    base, _ = served
    import concurrent.futures

    def ask(seed: int) -> str:
        return client(base).completions.create(model=MODEL, prompt=PROMPT, max_tokens=60, temperature=1.0, seed=seed,
                                               extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True},
                                                           "method": ("none", "ngram", "draft")[seed % 3]},
                                               ).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(ask, range(8)))
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
