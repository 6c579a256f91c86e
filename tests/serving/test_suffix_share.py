"""Suffix decoding in the server: a tenant (API key) drafts from its own earlier responses only
by default, ``--suffix-share global`` and ``none``; concurrent requests each get their
single-request greedy output; the cache shows in /metrics."""

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from helpers import PROMPTS, decoder
from server_helpers import MODEL, PROMPT, running_server
from server_helpers import metric as _metric

from specdecode import SamplingParams, SpecDecoder
from specdecode.drafters.suffix_cache import DEFAULT_GROUP
from specdecode.serving.server import ServerOptions, create_app
from specdecode.serving.suffix_share import ANONYMOUS, suffix_group
from specdecode.serving.worker import BatchWorker

TOKENS = 32


@contextmanager
def suffix_server(target_dir: Path, share: str, batched: bool = True) -> Iterator[tuple[str, SpecDecoder]]:
    """A server whose default method is suffix, over a decoder with its own empty cache;
    ``batched`` False: one request at a time (``--max-batch 1``)."""
    base = decoder(target_dir, None, "none")
    dec = SpecDecoder(base.target, None, replace(base.config, method="suffix"))
    worker = BatchWorker(dec.batch_engine(max_batch=4 if batched else 1, kv_cache_tokens=1024, cost_aware=False))
    app = create_app(dec, MODEL, worker=worker, options=ServerOptions(suffix_share=share))
    try:
        with running_server(app) as url:
            yield url, dec
    finally:
        worker.close()


def complete(url: str, key: str | None, prompt: str = PROMPT) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "k": 8}
    response = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_suffix_group_of_a_request() -> None:
    assert suffix_group("none", "Bearer alice") is None
    assert suffix_group("global", "Bearer alice") == DEFAULT_GROUP
    alice, bob = suffix_group("tenant", "Bearer alice"), suffix_group("tenant", "bearer  bob ")
    assert alice != bob and alice.startswith("tenant:") and "alice" not in alice
    assert suffix_group("tenant", None) == suffix_group("tenant", "Basic xyz") == ANONYMOUS


@pytest.mark.parametrize("batched", [True, False])
def test_tenants_draft_from_their_own_responses_only(tiny_qwen2_dir: Path, batched: bool) -> None:
    with suffix_server(tiny_qwen2_dir, "tenant", batched) as (url, dec):
        expected = dec.generate(PROMPT, SamplingParams(max_new_tokens=TOKENS), method="none").text
        first = complete(url, "alice")
        again = complete(url, "alice")  # alice's first answer is in alice's tree
        bob = complete(url, "bob")  # bob has none: he must not speculate on alice's answer
        for reply in (first, again, bob):
            assert reply["choices"][0]["text"] == expected
        tau = {name: reply["specdecode"]["tau"] for name, reply in (("first", first), ("again", again), ("bob", bob))}
        assert tau["again"] > tau["first"] and tau["again"] > tau["bob"], tau
        assert dec.suffix_cache.stats().groups == 2
        assert _metric(url, "specdecode_suffix_cache_groups") == 2
        assert _metric(url, "specdecode_suffix_cache_tokens") == dec.suffix_cache.stats().tokens > 0


def test_global_share_and_no_share(tiny_qwen2_dir: Path) -> None:
    with suffix_server(tiny_qwen2_dir, "global") as (url, dec):
        first, bob = complete(url, "alice"), complete(url, "bob")  # bob drafts from alice's answer
        assert bob["choices"][0]["text"] == first["choices"][0]["text"]
        assert bob["specdecode"]["tau"] > first["specdecode"]["tau"]
        assert dec.suffix_cache.stats().groups == 1
    with suffix_server(tiny_qwen2_dir, "none") as (url, dec):
        first, again = complete(url, "alice"), complete(url, "alice")
        assert again["specdecode"]["tau"] == first["specdecode"]["tau"]  # nothing kept between requests
        assert dec.suffix_cache.stats().tokens == 0


def test_concurrent_requests_of_one_tenant_keep_their_greedy_output(tiny_qwen2_dir: Path) -> None:
    prompts = PROMPTS[:4] * 2
    with suffix_server(tiny_qwen2_dir, "tenant") as (url, dec):
        expected = {p: dec.generate(p, SamplingParams(max_new_tokens=TOKENS), method="none").text for p in prompts}
        replies: dict[int, str] = {}

        def send(index: int) -> None:
            replies[index] = complete(url, "alice", prompts[index])["choices"][0]["text"]

        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert [replies.get(i) for i in range(len(prompts))] == [expected[p] for p in prompts]
        assert dec.suffix_cache.stats().responses == len(prompts)


def complete_salted(url: str, key: str, salt: str) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "k": 8, "cache_salt": salt}
    response = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("batched", [True, False])
def test_one_key_with_another_salt_drafts_from_its_own_responses_only(tiny_qwen2_dir: Path, batched: bool) -> None:
    """The salt isolates suffix drafts as it isolates cached prefixes (suffix_share.tenant_key)."""
    with suffix_server(tiny_qwen2_dir, "tenant", batched) as (url, dec):
        output_ids = dec.generate(PROMPT, SamplingParams(max_new_tokens=TOKENS), method="none").token_ids
        first = complete_salted(url, "alice", "s1")
        context = output_ids[:4]  # the start of the answer the server kept

        def drafted(salt: str | None) -> int:
            """Tokens the group of alice with this salt drafts after the first answer's start."""
            draft = dec.suffix_cache.draft(suffix_group("tenant", "Bearer alice", salt), context, max_nodes=8,
                                           max_depth=8, min_prob=0.0, max_match=16)
            return len(draft.tokens)

        assert drafted("s1") > 0 and drafted("s2") == 0 and drafted(None) == 0  # kept under s1's group only
        again = complete_salted(url, "alice", "s1")  # drafts from the first answer
        other = complete_salted(url, "alice", "s2")  # must not: another salt is another tenant
        for reply in (again, other):
            assert reply["choices"][0]["text"] == first["choices"][0]["text"]
        assert again["specdecode"]["tau"] > first["specdecode"]["tau"]
        assert again["specdecode"]["tau"] > other["specdecode"]["tau"], (again["specdecode"], other["specdecode"])
        assert dec.suffix_cache.stats().groups == 2
