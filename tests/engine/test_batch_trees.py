"""Token trees in the batch engine (torch): a row's tree is scored in the same padded pass as
the other rows' chains (kv/paged.py: per-row tree masks and rotary positions), and the
accepted path's K/V are kept by index copy.

- The pass itself: each tree node's logits equal a plain pass over its own path, next to a
  chain row, and after ``keep_path`` the sequence decodes as if the path had been fed in a line
  (fp32, allclose at 1e-4: different shapes round differently, no near-tie is involved).
- Suffix rows draft trees (wider than deep) and every greedy row equals plain decoding of its
  request alone, exact in fp32, under both batch policies and through preemption and aborts.
- Sampled suffix tree rows in mixed batches keep the target's distribution: chi-square at
  p = 0.001 over 1,500 draws, with a power check (a tree verifier that forgets to take a
  rejected child out of the residual fails the same test).
Grammar masks, penalties and logprobs on tree rows: tests/engine/test_structured.py,
test_penalties.py and test_logprobs.py, whose batched suffix rows draft trees here.
"""

import functools
import itertools
from pathlib import Path

import pytest
import torch
from helpers import (
    CHI2_CRITICAL_P001,
    DRAWS,
    PROMPTS,
    broken_rejection_tree_verify,
    chi_square_in_mixed_batches,
    decoder,
    last_logits,
    run_aborting,
)

import specdecode.engine.batch_verify
from specdecode import SamplingParams
from specdecode.backends.torch_batch import PagedBatchModel
from specdecode.core.tree import TokenTree
from specdecode.engine.batch import BatchEngine
from specdecode.engine.metrics import GenerationStats

REPEATING = ["def add(a, b):\n    return a + b\n\n" * 3, "1, 2, 3, 1, 2, 3, 1, 2, 3,", "the cat and the cat and the"]
TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 5]  # two branches at the root and at node 1, a chain under node 2


@pytest.fixture(scope="module")
def dec(tiny_qwen2_dir: Path):
    return decoder(tiny_qwen2_dir, None, method="none")


def engine(dec, **kwargs) -> BatchEngine:
    options = {"max_batch": 4, "kv_cache_tokens": 1024, "block_size": 4} | kwargs
    return BatchEngine(dec.target.model, None, dec.eos_token_ids, **options)


def assert_pool_empty(eng: BatchEngine) -> None:
    assert eng.target_cache.free_blocks == eng.target_cache.usable_blocks and not eng.target_cache.tables


# -- the pass ---------------------------------------------------------------------------------------
def prefilled(model: PagedBatchModel, seq: int, prompt: list[int], extra: int) -> None:
    """``seq`` holds ``prompt`` but its last token (the invariant between steps), with room for ``extra`` more."""
    model.pool.add(seq)
    model.pool.reserve(seq, len(prompt) - 1)
    model.forward([seq], [torch.tensor(prompt[:-1])], [0], logits="none")
    model.commit(seq, len(prompt) - 1)
    model.pool.reserve(seq, len(prompt) + extra)  # a commit frees the blocks past what it keeps


@torch.inference_mode()
def test_a_tree_row_scores_each_node_as_its_own_path_beside_a_chain_row(dec) -> None:
    model = PagedBatchModel.with_pool(dec.target.model, 256, block_size=4)
    tree_prompt, chain_prompt = dec.encode(PROMPTS[0]), dec.encode(PROMPTS[1])
    prefilled(model, 0, tree_prompt, len(TREE_PARENTS))
    prefilled(model, 1, chain_prompt, 3)
    drafted = [5, 9, 17, 23, 42, 77]  # any tokens: logits are compared, not accepted
    tree = TokenTree(TREE_PARENTS, torch.tensor([tree_prompt[-1], *drafted]), [False] * len(TREE_PARENTS))
    chain = torch.tensor([chain_prompt[-1], 11, 13])
    root = len(tree_prompt) - 1
    logits = model.forward([0, 1], [tree.tokens, chain], [root, len(chain_prompt) - 1],
                           trees=[TREE_PARENTS, None])  # (2, 7, V)
    for node in range(tree.size):
        path = [int(tree.tokens[n]) for n in tree.path_to(node)[1:]]
        torch.testing.assert_close(logits[0, node], last_logits(dec, tree_prompt + path), atol=1e-4, rtol=0)
    for j in range(chain.shape[0]):
        torch.testing.assert_close(logits[1, j], last_logits(dec, chain_prompt + chain[1 : j + 1].tolist()),
                                   atol=1e-4, rtol=0)
    # Keep the path root -> 2 -> 5 -> 6: the sequence now decodes as if it had been fed in a line.
    path = tree.path_to(6)
    model.keep_path(0, root, path)
    model.commit(0, root + len(path))
    line = tree_prompt + [int(tree.tokens[n]) for n in path[1:]]
    model.pool.reserve(0, len(line) + 1)
    after = model.forward([0], [torch.tensor([31])], [len(line)])  # (1, 1, V)
    torch.testing.assert_close(after[0, 0], last_logits(dec, line + [31]), atol=1e-4, rtol=0)


# -- greedy: each row equals its request alone -----------------------------------------------------
def cases(methods: tuple[str, ...], waves: int = 2) -> list[tuple[str, str, int, int]]:
    """(prompt, method, k, max_new_tokens): every prompt ``waves`` times, so later suffix rows
    draft from the earlier answers in the shared tree (branching trees, accepted paths)."""
    prompts = (REPEATING + PROMPTS[:4]) * waves
    return list(zip(prompts, itertools.cycle(methods), itertools.cycle([2, 4, 8]), itertools.cycle([24, 9, 30, 16]),
                    strict=False))


def run_cases(dec, eng: BatchEngine, batch) -> tuple[list[list[int]], list[GenerationStats]]:
    stats = [GenerationStats() for _ in batch]
    ids = [eng.add_request(dec.encode(p), SamplingParams(max_new_tokens=n), m, k, stats=s)
           for (p, m, k, n), s in zip(batch, stats, strict=True)]
    outputs = eng.run()
    return [outputs[i] for i in ids], stats


def plain(dec, batch) -> list[list[int]]:
    return [dec.generate(p, SamplingParams(max_new_tokens=n), method="none").token_ids for p, _, _, n in batch]


@pytest.mark.parametrize("policy", ["async", "sync"])
def test_suffix_tree_rows_equal_plain_decoding(dec, policy: str) -> None:
    batch = cases(("suffix", "none", "suffix", "ngram"))
    eng = engine(dec, policy=policy)
    outputs, stats = run_cases(dec, eng, batch)
    assert outputs == plain(dec, batch)
    assert_pool_empty(eng)
    trees = [s for (_, m, _, _), s in zip(batch, stats, strict=True) if m == "suffix"]
    # Trees, not chains: more nodes drafted than the deepest path each step could accept.
    assert sum(s.tree_nodes_proposed for s in trees) > sum(s.draft_tokens_proposed for s in trees) > 0
    assert sum(s.draft_tokens_accepted for s in trees) > 0


def test_suffix_tree_rows_survive_preemption_and_aborts(dec) -> None:
    batch = [(p, m, 4, 30) for p, m in zip((REPEATING[1:] + PROMPTS[:4]) * 2, itertools.cycle(("suffix", "none")))]
    eng = engine(dec, max_batch=8, kv_cache_tokens=96)
    stats = [GenerationStats() for _ in batch]
    ids = [eng.add_request(dec.encode(p), SamplingParams(max_new_tokens=n), m, k, stats=s)
           for (p, m, k, n), s in zip(batch, stats, strict=True)]
    aborted = eng.add_request(dec.encode(REPEATING[2]), SamplingParams(max_new_tokens=30), "suffix", 4)
    generated = run_aborting(eng, aborted, 6)
    assert eng.scheduler.preemptions > 0
    assert [generated[i] for i in ids] == plain(dec, batch)
    assert sum(s.tree_nodes_proposed for s in stats) > 0
    assert_pool_empty(eng)


# -- sampling: the target's distribution --------------------------------------------------------------
def tree_chi_square(dec, eng: BatchEngine) -> tuple[float, int, list[GenerationStats]]:
    """``helpers.chi_square_in_mixed_batches`` for suffix rows: 1,500 seeded suffix requests
    (k = 2, 3 tokens, top-k 3) of one prompt beside sampled rows of other prompts and methods
    (one in ten). Each token is drafted from the shared tree of earlier samples: a tree one deep
    whose root branches over the continuations seen after it (its children cover most of p,
    so a verifier that mishandles a rejected child shows). Pearson's statistic against the exact distribution, and
    the suffix rows' stats."""
    return chi_square_in_mixed_batches(dec, eng, dec.encode("def quicksort(arr):"), "suffix",
                                       ("ngram", "none", "suffix"))


def test_sampled_suffix_tree_rows_match_the_target_distribution(tiny_qwen2_dir: Path) -> None:
    dec = decoder(tiny_qwen2_dir, None, method="none")
    eng = engine(dec, max_batch=16, kv_cache_tokens=2048, block_size=8)
    stat, df, stats = tree_chi_square(dec, eng)
    assert_pool_empty(eng)
    nodes = sum(s.tree_nodes_proposed for s in stats)
    assert nodes >= DRAWS // 2, "the suffix rows should draft in most draws"
    assert nodes > sum(s.draft_tokens_proposed for s in stats), "trees that branch, not chains"
    assert stat < CHI2_CRITICAL_P001[df], f"chi2={stat:.1f} df={df}"


def test_the_tree_distribution_test_catches_a_wrong_residual(tiny_qwen2_dir: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    broken = functools.partial(broken_rejection_tree_verify, broken_kind="deterministic")
    monkeypatch.setattr(specdecode.engine.batch_verify, "rejection_tree_verify", broken)
    dec = decoder(tiny_qwen2_dir, None, method="none")
    stat, df, _ = tree_chi_square(dec, engine(dec, max_batch=16, kv_cache_tokens=2048, block_size=8))
    assert stat > CHI2_CRITICAL_P001[df], f"chi2={stat:.1f} df={df}: the test has no power against this bug"
