"""Drafts from the context: the index against brute force, the suffix tree and the grafted branch by hand, the
budget's split on made-up curves, and both drafters against plain greedy decoding."""

import dataclasses
import inspect
import random
from collections import Counter

import pytest
import torch
from conftest import VOCAB, reference_greedy, tiny_model

from tr_core import AdjacencyMatrix, PlainDrafter, load_template, run
from tr_core.beyond.context import BranchAcceptance, ContextRecyclingDrafter, PlusRecyclingDrafter, graft, split_budget
from tr_core.beyond.ngrams import ContextIndex
from tr_core.beyond.suffix import SuffixDrafter
from tr_core.budget import TreeBudget, candidate_sizes, step_time
from tr_core.drafters import Drafter, Outcome, nested_trees

# --- the index ------------------------------------------------------------------------------------------------------

def brute_match(seq: list[int], max_match: int) -> tuple[int, list[int]]:
    """The longest suffix (at most ``max_match`` tokens) that also ends at an earlier position, and all those
    earlier end positions, ascending."""
    last = len(seq) - 1
    for n in range(min(max_match, last), 0, -1):
        ends = [e for e in range(n - 1, last) if seq[e - n + 1:e + 1] == seq[last - n + 1:]]
        if ends:
            return n, ends
    return 0, []


def random_sequences(count: int, seed: int):
    rng = random.Random(seed)
    for _ in range(count):
        vocab, length = rng.choice([2, 3, 5, 20]), rng.randint(1, 120)
        yield rng, [rng.randrange(vocab) for _ in range(length)]


@pytest.mark.parametrize("max_match", [1, 3, 16])
def test_the_longest_match_equals_brute_force_as_the_index_grows_in_chunks(max_match):
    for rng, seq in random_sequences(60, seed=max_match):
        index, at = ContextIndex(max_match=max_match), 0
        while at < len(seq):
            step = rng.randint(1, 7)
            index.extend(seq[at:at + step])
            at = min(at + step, len(seq))
            assert index.tokens == seq[:at]
            assert index.longest_match() == brute_match(seq[:at], max_match), seq[:at]
            match, ends = brute_match(seq[:at], max_match)
            assert index.longest_match(limit=3) == (match, ends[-3:])


def test_continuations_count_what_followed_the_latest_occurrences():
    for rng, seq in random_sequences(80, seed=1):
        depth, limit = rng.randint(1, 6), rng.randint(1, 5)
        trie = ContextIndex(seq, max_match=4).continuations(depth, limit)
        match, ends = brute_match(seq, 4)
        ends = ends[-limit:]
        assert (trie.match, trie.occurrences, trie.counts[0]) == (match, len(ends), len(ends))
        expected = Counter(tuple(seq[e + 1:e + 1 + depth][:d]) for e in ends for d in range(1, depth + 1)
                           if e + d < len(seq))
        paths = {}
        for i in range(1, len(trie.tokens)):
            assert 0 <= trie.parents[i] < i and i in trie.children[trie.parents[i]]
            paths[i] = paths.get(trie.parents[i], ()) + (trie.tokens[i],)
        assert {paths[i]: trie.counts[i] for i in paths} == dict(expected)
        assert len(set(paths.values())) == len(paths)  # a trie: no path twice


def test_a_hand_worked_match_and_its_likeliest_chain():
    index = ContextIndex([7, 1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 5, 1, 2])
    assert index.longest_match() == (2, [2, 6, 10])  # [1, 2] ended at 2, 6 and 10; [5, 1, 2] never before
    trie = index.continuations(depth=3)
    assert trie.chain(3) == [3, 9, 1]  # 3 followed twice, 4 once
    assert index.continuations(depth=3, max_occurrences=1).chain(3) == [4, 5, 1]  # the latest alone
    assert ContextIndex([4, 5, 6]).continuations(depth=3).tokens == [6]  # no match: the root alone


def test_matches_longer_than_max_match_count_as_max_match():
    seq = [1, 2, 3, 4, 8, 9, 3, 4, 7, 1, 2, 3, 4]
    assert ContextIndex(seq, max_match=4).longest_match() == (4, [3])
    assert ContextIndex(seq, max_match=2).longest_match() == (2, [3, 7])  # [3, 4] also ended at 7
    assert ContextIndex(seq, max_match=2).continuations(depth=1).chain(1) == [7]  # the latest occurrence's


# --- the suffix drafter -------------------------------------------------------------------------------------------

def check_tree(tokens: torch.Tensor, tree, root: int, max_nodes: int) -> None:
    parents = tree.parents.tolist()
    assert tokens.dtype == torch.long and tokens.numel() == tree.size and int(tokens[0]) == root
    assert tree.size - 1 <= max_nodes and parents[0] == -1
    assert all(0 <= p < i for i, p in enumerate(parents) if i)
    assert tree.size == 1 or (tree.sources[0] == "root" and set(tree.sources[1:]) <= {"context", "matrix"})
    children = [(p, int(tokens[i])) for i, p in enumerate(parents) if i]
    assert len(children) == len(set(children)), "two children of one node share a token"


def test_the_suffix_tree_is_valid_and_drafts_the_most_frequent_continuations():
    for rng, seq in random_sequences(80, seed=2):
        max_nodes = rng.randint(1, 10)
        drafter = SuffixDrafter(max_nodes=max_nodes)
        tokens, tree = unpack(drafter.propose(torch.tensor(seq)))
        check_tree(tokens, tree, seq[-1], max_nodes)
        if brute_match(seq, 16)[0] == 0 or len(seq) < 2:
            assert tree.size == 1
        else:
            assert tree.size > 1 and tree.name == "suffix" and set(tree.sources[1:]) == {"context"}
            assert tree.ranks.tolist()[1:] == [-1] * (tree.size - 1)
    # by hand: [1, 2] was followed by 3, 1, 2 twice, by 4, 1, 2 once: three nodes take the first, four add 4
    context = torch.tensor([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2])
    tokens, tree = unpack(SuffixDrafter(max_nodes=3).propose(context))
    assert tokens.tolist() == [2, 3, 1, 2] and tree.parents.tolist() == [-1, 0, 1, 2]
    tokens, tree = unpack(SuffixDrafter(max_nodes=4).propose(context))
    assert tokens.tolist() == [2, 3, 4, 1, 2] and tree.parents.tolist() == [-1, 0, 0, 1, 3]


def test_the_suffix_drafter_follows_a_growing_context_and_respects_min_match():
    drafter = SuffixDrafter(max_nodes=4, min_match=2)
    assert drafter.propose(torch.tensor([5, 6, 7, 5])).tree.size == 1  # [5] matched, but only 1 token
    tokens = drafter.propose(torch.tensor([5, 6, 7, 5, 6])).tokens
    assert tokens.tolist() == [6, 7, 5, 6] and len(drafter.index) == 5
    tokens = drafter.propose(torch.tensor([1, 2, 1])).tokens  # a shorter context: a new request, a new index
    assert tokens.tolist() == [1] and drafter.index.tokens == [1, 2, 1]


# --- the split of the node budget -------------------------------------------------------------------------------

SIZES = [1, 2, 4, 8, 16]
EXPECTED = [1.0, 1.5, 1.9, 2.2, 2.4]  # tokens per step of the matrix tree, bonus included
RELIABLE = [0.95 ** (j + 1) for j in range(10)]
WEAK = [0.3 * 0.5 ** j for j in range(10)]


def cheap(n):
    return 10 + 0.05 * n


def steep(n):
    return 10 + 5.0 * n


def test_a_cheap_curve_gives_a_reliable_match_a_long_branch():
    step_ms = [cheap(n) for n in SIZES]
    # (2.2 + 7.6) / 10.9 ms beats (2.4 + 7.6) / 11.3 ms: the branch's nodes are worth more than the tree's last 8
    assert split_budget(SIZES, step_ms, EXPECTED, RELIABLE, max_size=16) == (8, 10)
    assert split_budget(SIZES, step_ms, EXPECTED, RELIABLE, max_size=4) == (4, 10)  # never above the budget's size
    assert split_budget(SIZES, step_ms, EXPECTED, [], max_size=8) == (8, 0)  # no continuation: the matrix alone
    assert split_budget(SIZES, step_ms, EXPECTED, RELIABLE, max_size=16, min_size=16) == (16, 10)  # size fixed


def test_a_steep_curve_gives_a_weak_match_no_branch():
    step_ms = [steep(n) for n in SIZES]
    assert split_budget(SIZES, step_ms, EXPECTED, WEAK, max_size=16) == (2, 0)  # 1.5 / 20 ms: the budget's own best
    # a middling curve: the reliable branch's first nodes are worth more than the matrix tree's last ones
    step_ms = [10 + 0.5 * n for n in SIZES]
    size, length = split_budget(SIZES, step_ms, EXPECTED, RELIABLE, max_size=16)
    assert size < 16 and length >= 5
    assert split_budget(SIZES, step_ms, EXPECTED, WEAK, max_size=16)[1] < length


def test_split_budget_maximises_tokens_per_ms_by_brute_force():
    rng = random.Random(5)
    for _ in range(200):
        step_ms = sorted(rng.uniform(5, 50) for _ in SIZES)
        expected = sorted(rng.uniform(1, 3) for _ in SIZES)
        branch = sorted((rng.random() for _ in range(rng.randint(0, 10))), reverse=True)
        max_size = rng.choice(SIZES)
        size, length = split_budget(SIZES, step_ms, expected, branch, max_size)
        rate = {(n, L): (t + sum(branch[:L])) / step_time(SIZES, step_ms, n + L)
                for n, t in zip(SIZES, expected) if n <= max_size for L in range(len(branch) + 1)}
        assert rate[size, length] == pytest.approx(max(rate.values()))


def test_step_time_extrapolates_on_the_last_slope():
    assert [step_time([1, 3, 5], [10.0, 12.0, 16.0], n) for n in (1, 2, 3, 4, 5, 7)] == [10, 11, 12, 14, 16, 20]
    assert step_time([1, 3], [10.0, 9.0], 5) == 9.0  # never cheaper beyond the last size
    assert step_time([4], [10.0], 9) == 10.0


def test_branch_acceptance_learns_per_match_bucket():
    b = BranchAcceptance(max_branch=3, first=0.5, rate=0.5)
    assert [b.bucket(m) for m in (1, 2, 3, 4, 7, 8, 30)] == [0, 1, 2, 3, 3, 4, 4]
    b.observe(9, [True, True, False])
    assert b.estimates(12) == [0.75, 0.625, 0.0625] and b.estimates(1) == [0.5, 0.25, 0.125]


# --- the graft ----------------------------------------------------------------------------------------------------

def test_the_graft_merges_coinciding_tokens():
    tokens, parents = [7, 1, 2, 3, 4], [-1, 0, 0, 1, 1]
    assert graft(tokens, parents, [1, 4, 5]) == ([7, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 1, 4])
    assert graft(tokens, parents, [1, 3]) == (tokens, parents)  # wholly inside the tree: nothing new
    assert graft(tokens, parents, [9, 9]) == ([7, 1, 2, 3, 4, 9, 9], [-1, 0, 0, 1, 1, 0, 5])
    assert graft([7, 1, 1], [-1, 0, 0], [1, 2]) == ([7, 1, 1, 2], [-1, 0, 0, 1])  # the first equal child


def unpack(draft):
    return draft.tokens, draft.tree


def stub_time(drafter, outcome):
    """The outcome with the step time of the drafter's made-up curve instead of the machine's."""
    if outcome.is_prompt:
        return outcome
    return dataclasses.replace(outcome, forward_ms=10.0 + drafter.step * drafter.tree.size)


class StubTimed(ContextRecyclingDrafter):
    """A tr-context drafter whose budget sees the step times of its made-up curve, not the machine's: the same
    sizes every run, however loaded the machine."""

    def learn(self, outcome):
        return super().learn(stub_time(self, outcome))


class PlusStubTimed(PlusRecyclingDrafter):
    def learn(self, outcome):
        return super().learn(stub_time(self, outcome))


def context_drafter(matrix, step=0.05, explore_every=0, plus=False, **kwargs):
    """A tr-context drafter over the "small" template's nodes (BFS order standing for likeliest first), with a
    budget on a made-up linear curve of ``step`` ms per node."""
    order = list(load_template("small").node_paths[1:])
    sizes = candidate_sizes(len(order) + 1)
    acceptance = [1.0] + [0.6 ** len(p) for p in order]
    budget = TreeBudget(sizes, [10.0 + step * n for n in sizes], acceptance, explore_every=explore_every)
    drafter = (PlusStubTimed if plus else StubTimed)(matrix, nested_trees(order, sizes), budget, **kwargs)
    drafter.step = step
    return drafter


def distinct_rows_matrix(k=4, seed=0):
    """A matrix whose rows hold k distinct tokens each (a warm matrix: no two siblings share a token)."""
    g = torch.Generator().manual_seed(seed)
    m = AdjacencyMatrix(VOCAB, k)
    m.rows.copy_(torch.stack([torch.randperm(VOCAB, generator=g)[:k] for _ in range(VOCAB)]).to(torch.int32))
    return m


def test_the_grafted_tree_merges_the_branch_into_the_matrix_tree():
    matrix = distinct_rows_matrix()
    drafter = context_drafter(matrix)
    root = 10
    first, second = int(matrix.rows[root, 0]), int(matrix.rows[int(matrix.rows[root, 0]), 0])
    # the context's continuation of [.., 10]: the matrix's own first two tokens, then three new nodes
    fresh = [t for t in range(VOCAB) if t not in matrix.rows[second].tolist() + [root, first, second]][0]
    chain = [first, second, fresh, 200, root]
    assert len({root, first, second, fresh, 200}) == 5
    proposed = drafter.propose(torch.tensor([root] + chain))
    tokens, tree, report = proposed.tokens, proposed.tree, proposed.estimates
    check_tree(tokens, tree, root, 100)
    size = report["matrix_nodes"] + 1
    # on a cheap curve, the whole continuation: 5 tokens, of which 3 new nodes (the first two merged)
    assert report["match"] == 1 and report["branch_length"] == 5 and report["context_branch"] == 3
    matrix_tokens = matrix.retrieve(root, drafter.nested.trees[drafter._index[size]])
    assert size >= 3 and tree.size == size + 3 and tree.name == "tr-context"  # first and second merged
    assert tree.sources.count("context") == 3 and tree.sources.count("matrix") == size - 1
    assert sorted(tokens[[s == "matrix" for s in tree.sources]].tolist()) == sorted(matrix_tokens[1:].tolist())
    # the branch is one root-to-leaf path of the tree
    assert any(tokens[list(p)].tolist() == [root] + chain for p in tree.path_lists)
    assert all(tree.ranks[i] == -1 for i, s in enumerate(tree.sources) if s == "context")


def test_the_drafter_teaches_the_budget_only_its_matrix_nodes_and_the_branch_its_own():
    matrix = distinct_rows_matrix()
    drafter = context_drafter(matrix, branch=BranchAcceptance(max_branch=10, rate=0.5))
    budget = drafter.budget
    root = 10
    first = int(matrix.rows[root, 0])
    fresh = [t for t in range(VOCAB) if t not in matrix.rows[first].tolist()][:2]
    context = [root, first] + fresh + [root]
    proposed = drafter.propose(torch.tensor(context))
    tokens, tree = proposed.tokens, proposed.tree
    size = proposed.estimates["matrix_nodes"] + 1
    assert budget.sizes[budget.current] == size
    # the accepted path: root -> first (a matrix node, merged) -> fresh[0] (a context node); the bonus: fresh[1]
    toks = tokens.tolist()
    a = next(i for i in range(1, tree.size) if toks[i] == first and tree.parents[i] == 0)
    b = next(i for i in range(1, tree.size) if toks[i] == fresh[0] and tree.parents[i] == a)
    assert tree.sources[a] == "matrix" and tree.sources[b] == "context"
    top = torch.zeros(tree.size, 4, dtype=torch.long)
    top[b, 0] = fresh[1]
    before, speed = list(budget.acceptance), budget.speed
    twice = 2 * step_time(budget.sizes, drafter._step_ms, tree.size)  # twice the step's estimated time
    # the real learn, not the stub's: the machine's time
    rows = ContextRecyclingDrafter.learn(drafter, Outcome(tokens, torch.tensor([0, a, b]), top, None, twice))
    assert {r.token for r in rows} == set(toks)  # every verified token's row, context nodes' included
    assert matrix.rows[fresh[0], 0] == fresh[1]
    # the budget: position 1 (the matrix tree's likeliest node) moved up, the other matrix positions down, those
    # above the matrix tree that ran untouched
    assert budget.acceptance[1] > before[1]
    assert all(budget.acceptance[j] < before[j] for j in range(2, size))
    assert budget.acceptance[size:] == before[size:]
    # the branch [first, fresh0, fresh1, root]: its first three tokens were produced, the fourth drafted and not
    assert drafter.branch.estimates(1)[:4] == [0.75, 0.625, 0.5625, 0.0625 / 2]
    assert budget.speed > speed


def test_a_step_where_the_budget_explores_runs_the_size_it_explores():
    drafter = context_drafter(distinct_rows_matrix(), explore_every=2)
    context = torch.tensor([10, 11, 12, 13, 10])  # [10] was followed by 11, 12, 13, 10: a branch of 4
    sizes = drafter.budget.sizes
    for step in range(6):
        proposed = drafter.propose(context)
        tokens, tree, report = proposed.tokens, proposed.tree, proposed.estimates
        ran, best = sizes.index(report["matrix_nodes"] + 1), sizes.index(report["best"] + 1)
        assert report["explored"] == (step % 2 == 1)
        assert step or report["context_branch"] == 4  # then shorter: the branch's tokens are never produced here
        assert abs(ran - best) == 1 if report["explored"] else ran <= best  # explored: the neighbour itself
        drafter.learn(Outcome(tokens, torch.tensor([0]), torch.zeros(tree.size, 4, dtype=torch.long), None, 10.0))


# --- decoding ----------------------------------------------------------------------------------------------------

def test_both_drafters_have_the_two_verbs_and_declare_what_they_learn_from():
    drafters = {"suffix": SuffixDrafter(), "tr-context": context_drafter(AdjacencyMatrix(VOCAB, 4))}
    for name, drafter in drafters.items():
        assert drafter.name == name and drafter.needs.prefill is False
        for method in ("propose", "learn"):
            assert (list(inspect.signature(getattr(drafter, method)).parameters)
                    == list(inspect.signature(getattr(Drafter, method)).parameters)[1:]), f"{name}.{method}"
    assert drafters["suffix"].needs.top_k == 0 and drafters["tr-context"].needs.top_k == 4


def repetitive_prompts(seed: int, vocab: int, count: int = 4):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        span = torch.randint(0, vocab, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        out.append(span * 3 + span[:2])
    return out


def context_accepted(events) -> int:
    return sum(1 for e in events for i in e.accepted_path if e.tree_sources and e.tree_sources[i] == "context")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_drafts_from_the_context_stay_exact(arch):
    # a 16-token vocabulary: the tiny random model's greedy output repeats itself, so the context has matches
    model, new = tiny_model(arch, vocab=16), 48
    accepted = {"suffix": 0, "tr-context": 0, "tr-plus": 0}
    for prompt in repetitive_prompts(len(arch), 16):
        ref = reference_greedy(model, prompt, new)
        assert run(model, prompt, PlainDrafter(), new).token_ids == ref
        for drafter in (SuffixDrafter(), context_drafter(AdjacencyMatrix(16, 4), explore_every=3),
                        context_drafter(AdjacencyMatrix(16, 4, keep_probs=True), explore_every=3, plus=True)):
            result = run(model, prompt, drafter, new)
            assert result.token_ids == ref, f"{arch} {drafter.name} differs from plain greedy decoding"
            # tr-plus: any accepted draft (its best-first tree often holds the branch's tokens already)
            accepted[drafter.name] += (sum(len(e.accepted_path) - 1 for e in result.events)
                                       if drafter.name == "tr-plus" else context_accepted(result.events))
            assert all(e.method == drafter.name for e in result.events)
            if drafter.name == "tr-plus":
                assert {s for e in result.events for s in e.tree_sources} <= {"root", "best-first", "context"}
            if drafter.name == "tr-context":
                assert all(e.budget == len(e.tree_tokens) - 1 for e in result.events)
                assert any(e.budget_estimates["context_branch"] for e in result.events)
    assert all(accepted.values()), f"no context node (tr-plus: no draft) was ever accepted: {accepted}"


def test_a_shared_budget_and_matrix_stay_exact_across_prompts(tiny):
    arch, model = tiny
    drafter_args = dict(branch=BranchAcceptance())
    matrix = AdjacencyMatrix(VOCAB, 4)
    for prompt in repetitive_prompts(7, VOCAB, count=3):
        ref = reference_greedy(model, prompt, 32)
        drafter = context_drafter(matrix, step=0.2, explore_every=2, **drafter_args)
        assert run(model, prompt, drafter, 32).token_ids == ref
