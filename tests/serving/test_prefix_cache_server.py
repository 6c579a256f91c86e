"""The prefix cache through the server: a chat's second turn reuses the first turn's K/V (OpenAI's
``usage.prompt_tokens_details.cached_tokens``), only within one tenant and ``cache_salt``, and
the answers equal those of a decoder without the cache."""

from pathlib import Path

import httpx
import pytest
from server_helpers import MODEL, client, metric, running_server

from specdecode import SamplingParams, SpecDecoder
from specdecode.serving.server import ServerOptions, create_app
from specdecode.serving.suffix_share import cache_group
from specdecode.serving.worker import BatchWorker

FIRST = [{"role": "user", "content": "Write a quicksort"}]
MAX_TOKENS = 12


def tiny(target: Path, **options) -> SpecDecoder:
    return SpecDecoder.from_pretrained(str(target), method="none", dtype="fp32", device="cpu", show_progress=False,
                                       **options)


@pytest.fixture(scope="module")
def single_server(tiny_qwen2_dir: Path):
    """A server decoding one request at a time (``--max-batch 1``)."""
    decoder = tiny(tiny_qwen2_dir)
    worker = BatchWorker(decoder.batch_engine(max_batch=1, kv_cache_tokens=1024, cost_aware=False))
    try:
        with running_server(create_app(decoder, MODEL, worker, options=ServerOptions())) as base:
            yield base
    finally:
        worker.close()


def chat(base: str, messages: list[dict], api_key: str = "key-a", **extra):
    return client(base, api_key).chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                         temperature=0, extra_body=extra or None)


def test_second_turn_is_served_from_the_cache_and_unchanged(single_server: str, tiny_qwen2_dir: Path) -> None:
    first = chat(single_server, FIRST)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second_messages = [*FIRST, {"role": "assistant", "content": first.choices[0].message.content},
                       {"role": "user", "content": "Now sort in place"}]
    second = chat(single_server, second_messages)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens
    reference = tiny(tiny_qwen2_dir, prefix_cache=False).generate(second_messages, SamplingParams(max_new_tokens=MAX_TOKENS),
                                                                  chat=True)
    assert second.choices[0].message.content == reference.text
    assert metric(single_server, "specdecode_prompt_tokens_cached_total") >= cached
    assert metric(single_server, "specdecode_prefix_cache_hits_total") >= 1


def test_another_tenant_or_salt_gets_no_cached_tokens(single_server: str) -> None:
    chat(single_server, FIRST, api_key="key-a")
    assert chat(single_server, FIRST, api_key="key-b").usage.prompt_tokens_details.cached_tokens == 0
    chat(single_server, FIRST, api_key="key-a")
    assert chat(single_server, FIRST, api_key="key-a").usage.prompt_tokens_details.cached_tokens > 0
    assert chat(single_server, FIRST, api_key="key-a", cache_salt="s1").usage.prompt_tokens_details.cached_tokens == 0
    assert chat(single_server, FIRST, api_key="key-a", cache_salt="s1").usage.prompt_tokens_details.cached_tokens > 0


def test_a_bad_cache_salt_is_a_400_naming_it(single_server: str) -> None:
    body = {"model": MODEL, "messages": FIRST, "cache_salt": ""}
    response = httpx.post(single_server + "/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt"


def test_cache_groups_separate_tenants_and_salts() -> None:
    anonymous = cache_group("tenant", None, None)
    assert cache_group("tenant", "Bearer a", None) != cache_group("tenant", "Bearer b", None) != anonymous
    assert cache_group("none", "Bearer a", None) == cache_group("tenant", "Bearer a", None)
    assert cache_group("global", "Bearer a", None) == cache_group("global", "Bearer b", None)
    assert cache_group("tenant", "Bearer a", "x") != cache_group("tenant", "Bearer a", None)
    assert "secret-salt" not in cache_group("tenant", "Bearer a", "secret-salt")  # groups hold hashes, not keys or salts


def test_batched_requests_reuse_the_prefix_too(tiny_qwen2_dir: Path) -> None:
    """The server's default path: the batch engine's paged pool shares the first turn's blocks."""
    from specdecode.serving.worker import BatchWorker

    decoder = tiny(tiny_qwen2_dir)
    worker = BatchWorker(decoder.batch_engine(max_batch=4, kv_cache_tokens=1024, cost_aware=False))
    try:
        with running_server(create_app(decoder, MODEL, worker=worker, options=ServerOptions())) as base:
            first = chat(base, FIRST)
            messages = [*FIRST, {"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "Now sort in place"}]
            second = chat(base, messages)
            assert second.usage.prompt_tokens_details.cached_tokens >= 16  # whole 16-token blocks of turn 1
            assert chat(base, messages, api_key="key-b").usage.prompt_tokens_details.cached_tokens == 0
            reference = tiny(tiny_qwen2_dir, prefix_cache=False).generate(messages, SamplingParams(max_new_tokens=MAX_TOKENS),
                                                                          chat=True)
            assert second.choices[0].message.content == reference.text
            assert metric(base, "specdecode_prefix_cache_hit_rate") > 0
            assert metric(base, "specdecode_prefix_cache_blocks") > 0
    finally:
        worker.close()
