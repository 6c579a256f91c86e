"""OpenAI's ``n`` through the server, with the official openai client: n choices of one prompt,
streamed and not, batched (none, draft: the choices after the first start from its prompt K/V)
and one at a time (--max-batch 1); choice i equals the request with n = 1 and seed + i, the choices
differ, usage counts the prompt once and every choice's tokens; logprobs come per choice."""

import json

import httpx
import pytest
from server_helpers import MESSAGES, MODEL, PROMPT, client, sse_data

SAMPLED = {"temperature": 1.0, "max_tokens": 10, "seed": 41}


def completions(base: str, **body) -> list[str]:
    reply = client(base).completions.create(model=MODEL, prompt=PROMPT, **body)
    assert [c.index for c in reply.choices] == list(range(len(reply.choices)))
    return [c.text for c in reply.choices]


@pytest.mark.parametrize("method", ["none", "draft"])
def test_choice_i_is_the_request_with_seed_plus_i(served, method: str) -> None:
    base, _ = served
    extra = {"method": method}
    texts = completions(base, n=3, extra_body=extra, **SAMPLED)
    alone = [completions(base, n=1, extra_body=extra, **(SAMPLED | {"seed": SAMPLED["seed"] + i}))[0] for i in range(3)]
    assert texts == alone
    assert len(set(texts)) > 1, "three seeded samples should not all be equal"


def test_usage_counts_the_prompt_once_and_every_choice(served) -> None:
    base, _ = served
    reply = client(base).completions.create(model=MODEL, prompt=PROMPT, n=4, extra_body={"method": "draft"}, **SAMPLED)
    alone = client(base).completions.create(model=MODEL, prompt=PROMPT, n=1, extra_body={"method": "draft"}, **SAMPLED)
    assert reply.usage.prompt_tokens == alone.usage.prompt_tokens
    assert reply.usage.completion_tokens == 4 * SAMPLED["max_tokens"]  # no stop: every choice runs to max_tokens
    assert [c.finish_reason for c in reply.choices] == ["length"] * 4
    metrics = reply.model_extra["specdecode"]["choices"]
    assert len(metrics) == 4 and all(m["method"] == "draft" for m in metrics)


@pytest.mark.parametrize("method", ["draft", "auto"])
def test_greedy_choices_are_the_greedy_output(served, method: str) -> None:
    base, _ = served
    want = completions(base, temperature=0, max_tokens=10, extra_body={"method": "none"})[0]
    assert completions(base, n=3, temperature=0, max_tokens=10, extra_body={"method": method}) == [want] * 3


def test_a_batch_of_one_draws_each_choice_apart(start_server) -> None:
    """With --max-batch 1 the choices decode one after another (the later ones start from the
    first one's prompt K/V). auto's draft lengths follow live measurements, so a seed does not
    pin its output across requests; the choices still differ."""
    with start_server(max_batch=1) as (base, _):
        reply = client(base).completions.create(model=MODEL, prompt=PROMPT, n=3, extra_body={"method": "auto"}, **SAMPLED)
    assert len({c.text for c in reply.choices}) > 1 and [c.index for c in reply.choices] == [0, 1, 2]


# auto samples are not pinned by a seed across requests (its draft lengths follow live costs): greedy there.
@pytest.mark.parametrize(("method", "temperature"), [("none", 1.0), ("auto", 0.0)])
def test_streamed_choices_equal_the_whole_ones(served, method: str, temperature: float) -> None:
    base, _ = served
    body = {"model": MODEL, "messages": MESSAGES, "n": 3, "method": method} | SAMPLED | {"temperature": temperature}
    whole = httpx.post(base + "/v1/chat/completions", json=body, timeout=60).json()
    with httpx.stream("POST", base + "/v1/chat/completions", json=body | {"stream": True}, timeout=60) as response:
        events = sse_data(response.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts, finishes, roles = ["", "", ""], [None] * 3, [0, 0, 0]
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        delta = choice["delta"]
        texts[choice["index"]] += delta.get("content") or ""
        roles[choice["index"]] += delta.get("role") == "assistant"
        finishes[choice["index"]] = choice["finish_reason"] or finishes[choice["index"]]
    assert texts == [c["message"]["content"] for c in whole["choices"]]
    assert finishes == [c["finish_reason"] for c in whole["choices"]] and roles == [1, 1, 1]
    usage = chunks[-1]["usage"]  # the second request found the first's prompt in the prefix cache
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == whole["usage"]["completion_tokens"]
    assert usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]


def test_each_choice_has_its_logprobs(served) -> None:
    base, _ = served
    reply = client(base).chat.completions.create(model=MODEL, messages=MESSAGES, n=2, logprobs=True, top_logprobs=2,
                                                 extra_body={"method": "draft"}, **SAMPLED)
    for choice in reply.choices:
        content = choice.logprobs.content
        assert len(content) == SAMPLED["max_tokens"]
        assert "".join(entry.token for entry in content) == choice.message.content
        assert all(len(entry.top_logprobs) == 2 for entry in content)
