"""Token trees and tree verification on hand-made tensors: exact tables and a distribution test."""

import functools
from collections import defaultdict
from collections.abc import Callable

import pytest
import torch
from helpers import broken_rejection_tree_verify
from torch.utils._python_dispatch import TorchDispatchMode

from specdecode.core.tree import TokenTree
from specdecode.engine.verify import (
    TreeVerifyResult,
    greedy_tree_verify,
    greedy_verify,
    rejection_tree_verify,
    typical_tree_verify,
)
from specdecode.kv.static import tree_view

T, F = True, False

#        0
#      /   \
#     1     2
#    / \     \
#   3   4     5
#   |
#   6
PARENTS = [-1, 0, 0, 1, 1, 2, 3]
ANCESTORS = [
    [T, F, F, F, F, F, F],
    [T, T, F, F, F, F, F],
    [T, F, T, F, F, F, F],
    [T, T, F, T, F, F, F],
    [T, T, F, F, T, F, F],
    [T, F, T, F, F, T, F],
    [T, T, F, T, F, F, T],
]


def small_tree(tokens: list[int] | None = None) -> TokenTree:
    tokens = list(range(len(PARENTS))) if tokens is None else tokens
    return TokenTree(PARENTS, torch.tensor(tokens), [False] * len(PARENTS))


def one_hot_logits(argmax_rows: list[int], vocab: int = 8) -> torch.Tensor:
    """(N, V) logits whose argmax at row i is argmax_rows[i]."""
    return torch.nn.functional.one_hot(torch.tensor(argmax_rows), vocab).float() * 5.0


# --- the tree itself -----------------------------------------------------------------------


def test_tree_structure_tables() -> None:
    tree = small_tree()
    assert tree.size == 7
    assert tree.depths == [0, 1, 1, 2, 2, 2, 3]
    assert tree.max_depth == 3
    assert tree.children() == [[1, 2], [3, 4], [5], [6], [], [], []]
    assert tree.path_to(0) == [0]
    assert tree.path_to(6) == [0, 1, 3, 6]
    assert tree.path_to(5) == [0, 2, 5]
    assert tree.positions(10, "cpu").tolist() == [[10, 11, 11, 12, 12, 12, 13]]
    assert tree.ancestor_mask("cpu").tolist() == ANCESTORS


def test_tree_view_sees_committed_slots_and_ancestors() -> None:
    view = tree_view(small_tree(), start=3, device="cpu")
    assert view.kv_len == 10
    assert view.mask.shape == (1, 1, 7, 10)
    assert view.mask[0, 0].tolist() == [[T, T, T, *row] for row in ANCESTORS]


def test_tree_view_sliding_window_uses_positions_not_slots() -> None:
    # Positions are 3 + depth = [3, 4, 4, 5, 5, 5, 6]; window 3 keeps keys at positions >= p - 2.
    # Node 6 (position 6) loses the root (position 3) although the root is its ancestor.
    view = tree_view(small_tree(), start=3, device="cpu", sliding_window=3)
    assert view.mask[0, 0].tolist() == [
        [F, T, T, T, F, F, F, F, F, F],
        [F, F, T, T, T, F, F, F, F, F],
        [F, F, T, T, F, T, F, F, F, F],
        [F, F, F, T, T, F, T, F, F, F],
        [F, F, F, T, T, F, F, T, F, F],
        [F, F, F, T, F, T, F, F, T, F],
        [F, F, F, F, T, F, T, F, F, T],
    ]


@pytest.mark.parametrize(
    "parents",
    [[], [0], [-1, 1], [-1, 0, 3], [-1, -1], [-1, 0, 2]],
)
def test_invalid_parents_raise(parents: list[int]) -> None:
    with pytest.raises(ValueError, match="parent"):
        TokenTree(parents, torch.zeros(len(parents), dtype=torch.long), [False] * len(parents))


def test_inconsistent_fields_raise() -> None:
    with pytest.raises(ValueError, match="tokens"):
        TokenTree([-1, 0], torch.zeros(3, dtype=torch.long), [False, False])
    with pytest.raises(ValueError, match="sampled has"):
        TokenTree([-1, 0], torch.zeros(2, dtype=torch.long), [False])
    with pytest.raises(ValueError, match="draft_probs"):
        TokenTree([-1, 0], torch.zeros(2, dtype=torch.long), [False, True])
    with pytest.raises(ValueError, match="sampled\\[0\\]"):
        TokenTree([-1, 0], torch.zeros(2, dtype=torch.long), [True, False], torch.ones(2, 4))
    with pytest.raises(ValueError, match="draft_probs must be"):
        TokenTree([-1, 0], torch.zeros(2, dtype=torch.long), [False, True], torch.ones(3, 4))


def test_chain_is_a_linear_tree() -> None:
    probs = torch.tensor([[0.5, 0.5, 0.0], [0.1, 0.2, 0.7]])
    tree = TokenTree.chain(torch.tensor([2]), torch.tensor([1, 0]), probs)
    assert tree.parents == [-1, 0, 1]
    assert tree.tokens.tolist() == [2, 1, 0]
    assert tree.sampled == [False, True, True]
    assert torch.equal(tree.draft_probs, torch.cat([probs, torch.zeros(1, 3)]))
    deterministic = TokenTree.chain(torch.tensor([2]), torch.tensor([1, 0]), None)
    assert deterministic.sampled == [False, False, False] and deterministic.draft_probs is None


# --- greedy -------------------------------------------------------------------------------


def test_greedy_whole_branch_matches_gets_bonus_token() -> None:
    # Rows 0, 1, 3 pick nodes 1, 3, 6 (their siblings 2 and 4 mismatch); row 6 gives the bonus.
    result = greedy_tree_verify(small_tree(), one_hot_logits([1, 3, 0, 6, 0, 0, 7]))
    assert result == TreeVerifyResult(path=[0, 1, 3, 6], tokens=[1, 3, 6, 7])


def test_greedy_takes_second_sibling_when_first_mismatches() -> None:
    result = greedy_tree_verify(small_tree(), one_hot_logits([2, 0, 5, 0, 0, 4, 0]))
    assert result == TreeVerifyResult(path=[0, 2, 5], tokens=[2, 5, 4])


def test_greedy_deep_match_under_mismatched_parent_is_not_accepted() -> None:
    # Nodes 3 and 6 match their parents' argmax, but node 1 does not match the root's, so the
    # deeper path 0-1-3-6 must lose to 0-2-5.
    result = greedy_tree_verify(small_tree(), one_hot_logits([2, 3, 5, 6, 0, 4, 7]))
    assert result == TreeVerifyResult(path=[0, 2, 5], tokens=[2, 5, 4])


def test_greedy_ties_go_to_the_lowest_node() -> None:
    # Nodes 1 and 2 carry the same token and both match; nothing below either matches.
    result = greedy_tree_verify(small_tree([0, 1, 1, 3, 4, 5, 6]), one_hot_logits([1, 7, 6, 0, 0, 0, 0]))
    assert result == TreeVerifyResult(path=[0, 1], tokens=[1, 7])


def test_greedy_root_only_tree_is_plain_argmax() -> None:
    result = greedy_tree_verify(TokenTree([-1], torch.tensor([5]), [False]), one_hot_logits([3]))
    assert result == TreeVerifyResult(path=[0], tokens=[3])


@pytest.mark.parametrize("seed", range(6))
def test_greedy_on_a_chain_equals_greedy_verify(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    k, vocab = 4, 8
    logits = torch.randn(k + 1, vocab, generator=gen)
    drafts = logits[:k].argmax(-1)
    wrong_at = seed % (k + 1)  # seed 4 and 5 keep the whole chain: bonus token
    if wrong_at < k:
        drafts[wrong_at] = (drafts[wrong_at] + 1) % vocab
    expected = greedy_verify(drafts[None], logits[None])
    result = greedy_tree_verify(TokenTree.chain(torch.tensor([0]), drafts, None), logits)
    accepted_len = expected.accepted_len.item()
    assert result.path == list(range(accepted_len + 1))
    assert result.tokens == expected.tokens[0, : accepted_len + 1].tolist()


class _ScalarReads(TorchDispatchMode):
    """Counts reads of one tensor element into Python (``.item()``, a 0-dim index): host syncs."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def test_greedy_and_typical_read_no_scalars_before_their_one_transfer() -> None:
    # Their single .tolist() does not dispatch; any hidden .item() would show up here.
    tree = small_tree()
    logits = torch.randn(7, 8, generator=torch.Generator().manual_seed(0))
    with _ScalarReads() as reads:
        greedy_tree_verify(tree, logits)
        typical_tree_verify(tree, logits.softmax(-1), torch.Generator().manual_seed(0))
    assert reads.count == 0


# --- rejection sampling: exact cases --------------------------------------------------------


def test_rejection_tree_follows_a_certain_target() -> None:
    # The target is certain of token 2 after the root, then of 5, then of 4: node 2 (after a
    # rejected node 1, probability 0) and node 5 must be accepted and 4 emitted as the bonus.
    target = one_hot_logits([2, 0, 5, 0, 0, 4, 0]).div(5.0)
    result = rejection_tree_verify(small_tree(), target, torch.Generator().manual_seed(0))
    assert result == TreeVerifyResult(path=[0, 2, 5], tokens=[2, 5, 4])


# --- rejection sampling: distribution test ------------------------------------------------
# The target is a Markov chain over a 6-token vocabulary: the row after a node at depth d with
# token t is P[d, t] (the root is depth 0 with token ROOT_TOKEN); the drafter's row there is
# Q[d, t] = 0.5 P[d, t] + 0.5 noise, like test_verify.py's tables. The tree is a complete
# binary tree of depth 3 (15 nodes, breadth-first), its children picked per case.
# Lossless property: given that node v (depth d, token t) was accepted, the token emitted
# right after it is distributed as P[d, t]; at the root this is the first emitted token.
# Statistic: total variation between that empirical distribution and P[d, t], per group
# (d, t), judged for groups reached >= 4,000 times out of 20,000 draws per case (with seed 1
# that is 4-7 groups per case, down to depth 2 or 3). A correct sampler's TV at 4,000 draws
# has mean ~0.011 and sd ~0.005 on these rows (less with more draws); threshold 0.03, about
# 4 sd above the mean. The broken samplers below (after a rejected sampled child, retry from p
# instead of the residual; after a rejected top-k pick, keep its token) reach TV ~0.15 and
# ~0.25, well over twice the threshold.

VOCAB = 6
TREE_DEPTH = 3
BRANCH = 2
ROOT_TOKEN = 0
DRAWS = 20_000
MIN_GROUP_DRAWS = 4_000  # groups reached fewer times are too noisy to judge
TV_THRESHOLD = 0.03
TABLE_SEED = 1  # tables whose trees are accepted deep enough to judge depth-2 groups
TREE_SIZE = sum(BRANCH**depth for depth in range(TREE_DEPTH + 1))
TREE_PARENTS = [-1] + [(node - 1) // BRANCH for node in range(1, TREE_SIZE)]  # breadth-first

SAMPLE = -1  # a child slot drawn from q; a slot r >= 0 is q's rank-r token (deterministic)
CASES: dict[str, Callable[[int, int], int]] = {
    # (parent depth, child slot) -> how that child is picked
    "top2": lambda depth, slot: slot,
    "sampled": lambda depth, slot: SAMPLE,
    # Both sibling orders: top-1 then a sample under even depths, a sample then top-1 under odd.
    "mixed": lambda depth, slot: (0, SAMPLE)[slot] if depth % 2 == 0 else (SAMPLE, 0)[slot],
}


def _markov_tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """P (D + 1, V, V) and Q (D, V, V): rows indexed by [depth, token]."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(TREE_DEPTH + 1, VOCAB, VOCAB, generator=gen).pow(3)
    p = p / p.sum(-1, keepdim=True)
    noise = torch.rand(TREE_DEPTH, VOCAB, VOCAB, generator=gen).pow(3)
    q = 0.5 * p[:TREE_DEPTH] + 0.5 * noise / noise.sum(-1, keepdim=True)
    return p, q


def _draw_trees(case: str, q: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, list[bool]]:
    """Tokens (DRAWS, N) of every draw's tree, and which nodes are sampled."""
    depths = [0] * TREE_SIZE
    tokens = torch.full((DRAWS, TREE_SIZE), ROOT_TOKEN, dtype=torch.long)
    sampled = [False] * TREE_SIZE
    for node in range(1, TREE_SIZE):
        parent = TREE_PARENTS[node]
        depths[node] = depths[parent] + 1
        rows = q[depths[parent], tokens[:, parent]]  # (DRAWS, V)
        pick = CASES[case](depths[parent], (node - 1) % BRANCH)
        if pick == SAMPLE:
            # Siblings are independent draws from the same q (with replacement).
            tokens[:, node] = torch.multinomial(rows, 1, generator=gen).squeeze(1)
            sampled[node] = True
        else:
            tokens[:, node] = rows.topk(pick + 1, dim=-1).indices[:, pick]
    return tokens, sampled


Verifier = Callable[[TokenTree, torch.Tensor, torch.Generator], TreeVerifyResult]


def _next_token_tv(verify_fn: Verifier, case: str, seed: int = TABLE_SEED) -> dict[tuple[int, int], float]:
    """TV per judged group (depth, token) of the accepted node's next emitted token."""
    p, q = _markov_tables(seed)
    gen = torch.Generator().manual_seed(seed + 100)
    tokens, sampled = _draw_trees(case, q, gen)
    depths = torch.tensor(TokenTree(TREE_PARENTS, tokens[0], [False] * TREE_SIZE).depths)
    target_rows = p[depths[None, :], tokens]  # (DRAWS, N, V)
    # Leaves have no children: their q row is never read, a zero row stands in.
    q_ext = torch.cat([q, torch.zeros(1, VOCAB, VOCAB)])
    draft_rows = q_ext[depths[None, :], tokens] if any(sampled) else None
    counts: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0] * VOCAB)
    for draw in range(DRAWS):
        draft_probs = None if draft_rows is None else draft_rows[draw]
        tree = TokenTree(TREE_PARENTS, tokens[draw], sampled, draft_probs)
        result = verify_fn(tree, target_rows[draw], gen)
        node_tokens = [ROOT_TOKEN, *result.tokens[:-1]]
        for depth, next_token in enumerate(result.tokens):
            counts[(depth, node_tokens[depth])][next_token] += 1
    tvs = {}
    for (depth, token), row in counts.items():
        if sum(row) >= MIN_GROUP_DRAWS:
            empirical = torch.tensor(row, dtype=torch.float) / sum(row)
            tvs[(depth, token)] = 0.5 * (empirical - p[depth, token]).abs().sum().item()
    return tvs


@pytest.mark.parametrize("case", list(CASES))
def test_rejection_tree_reproduces_target_distribution(case: str) -> None:
    tvs = _next_token_tv(rejection_tree_verify, case)
    # The tables must exercise acceptance: the root and groups down to depth 2 are judged.
    assert (0, ROOT_TOKEN) in tvs and max(depth for depth, _ in tvs) >= 2, tvs
    assert max(tvs.values()) < TV_THRESHOLD, tvs


@pytest.mark.parametrize(("broken_kind", "case"), [("sampled", "sampled"), ("deterministic", "top2")])
def test_distribution_test_detects_wrong_residual(broken_kind: str, case: str) -> None:
    broken = functools.partial(broken_rejection_tree_verify, broken_kind=broken_kind)
    tvs = _next_token_tv(broken, case)
    assert max(tvs.values()) > 2 * TV_THRESHOLD, tvs


# --- typical acceptance ---------------------------------------------------------------------


def _typical_case(root_row: list[float]) -> tuple[TokenTree, torch.Tensor]:
    """Root -> node 1 (token 1); the target after node 1 is certain of token 4."""
    vocab = len(root_row)
    target = torch.zeros(2, vocab)
    target[0] = torch.tensor(root_row)
    target[1, 4] = 1.0
    return TokenTree([-1, 0], torch.tensor([0, 1]), [False, False]), target


def test_typical_accepts_a_plausible_token_under_a_flat_target() -> None:
    # Token 1 has p = 0.08 and is not the argmax, so greedy rejects it; the row's entropy is
    # ~2.25 nats, so the cutoff is 0.3 * exp(-2.25) ~ 0.03 < 0.08 and typical acceptance keeps it.
    tree, target = _typical_case([0.2, 0.08] + [0.09] * 8)
    assert greedy_tree_verify(tree, target.log()).path == [0]
    result = typical_tree_verify(tree, target, torch.Generator().manual_seed(0))
    assert result == TreeVerifyResult(path=[0, 1], tokens=[1, 4])


def test_typical_rejects_the_same_probability_under_a_peaked_target() -> None:
    # Entropy ~0.28 nats: the cutoff is min(0.09, 0.3 * exp(-0.28)) = 0.09 > 0.08.
    tree, target = _typical_case([0.92, 0.08] + [0.0] * 8)
    result = typical_tree_verify(tree, target, torch.Generator().manual_seed(0))
    assert result.path == [0] and len(result.tokens) == 1 and result.tokens[0] in (0, 1)
