"""tr-dynamic: the best-first tree against a brute-force reference and by hand, the drafter's protocol and budget,
and decoding with it against plain greedy decoding."""

import inspect
import itertools

import pytest
import torch
from conftest import VOCAB, reference_greedy
from test_lossless import NEW_TOKENS, oracle_matrix, prompts

from tr_core import AdjacencyMatrix, run
from tr_core.beyond.dynamic import DynamicRecyclingDrafter, choose_size, grow_best_first
from tr_core.budget import TreeBudget, candidate_sizes
from tr_core.drafters import Drafter, Needs, Outcome
from tr_core.tree import tree_from_parents


def random_matrix(vocab: int, k: int, seed: int, written: float = 0.8, unknown: float = 0.1) -> AdjacencyMatrix:
    """Rows written with random ids and probabilities (a fraction never written, a fraction of unknown
    probabilities); the probabilities of a row are in no particular order."""
    g = torch.Generator().manual_seed(seed)
    m = AdjacencyMatrix(vocab, k, keep_probs=True)
    tokens = torch.arange(vocab)[torch.rand(vocab, generator=g) < written]
    top = torch.randint(1, vocab, (tokens.numel(), k), generator=g)
    m.update(tokens, top, probs=torch.rand(tokens.numel(), k, generator=g) / k)
    some = tokens[torch.rand(tokens.numel(), generator=g) < unknown]
    m.update(some, m.rows[some].long())  # ids kept, probabilities unknown
    return m


def row(m: AdjacencyMatrix, token: int) -> tuple[list[int], list[float]]:
    probs = m.probs[token].tolist()
    return m.rows[token].tolist(), (m.prior() if probs[0] != probs[0] else probs)


def rank_paths(parents: list[int], ranks: list[int]) -> list[tuple[int, ...]]:
    paths = [()]
    for i in range(1, len(parents)):
        paths.append(paths[parents[i]] + (ranks[i],))
    return paths


@pytest.mark.parametrize("seed", range(6))
def test_the_tree_is_valid_best_first_and_within_budget(seed):
    m = random_matrix(vocab=40, k=[2, 4, 8][seed % 3], seed=seed)
    for root, max_nodes in itertools.product([0, 3, 17, 39], [0, 1, 5, 8, 16, 32]):
        tokens, parents, ranks, probs = grow_best_first(m, root, max_nodes)
        assert tokens[0] == root and parents[0] == -1 and probs[0] == 1.0
        assert len(tokens) == len(parents) == len(ranks) == len(probs) <= max_nodes + 1
        assert all(a >= b for a, b in zip(probs[1:], probs[2:])), "not in best-first order"
        for i in range(1, len(tokens)):
            p = parents[i]
            assert 0 <= p < i  # every prefix is a tree
            ids, row_probs = row(m, tokens[p])
            assert tokens[i] == ids[ranks[i]] and probs[i] == probs[p] * row_probs[ranks[i]] > 0
        assert len(set(rank_paths(parents, ranks))) == len(tokens)  # no node twice
        tree, order = tree_from_parents(parents, ranks, sources=["root"] + ["best-first"] * (len(tokens) - 1))
        assert tree.size == len(tokens) and order[0] == 0


def brute_force(m: AdjacencyMatrix, root: int, depth: int) -> dict[tuple[int, ...], float]:
    """Every node of probability above 0 reachable from ``root`` within ``depth`` steps: rank path -> probability."""
    found, frontier = {}, [((), root, 1.0)]
    for _ in range(depth):
        nxt = []
        for path, token, p in frontier:
            ids, probs = row(m, token)
            for r, (t, q) in enumerate(zip(ids, probs)):
                if p * q > 0:
                    found[path + (r,)] = p * q
                    nxt.append((path + (r,), t, p * q))
        frontier = nxt
    return found


@pytest.mark.parametrize("seed", range(8))
def test_the_nodes_chosen_are_the_likeliest_reachable(seed):
    m = random_matrix(vocab=12, k=[2, 3][seed % 2], seed=100 + seed, written=0.7)
    for root, max_nodes in itertools.product(range(0, 12, 3), [1, 3, 6]):
        everything = brute_force(m, root, max_nodes)
        best = sorted(everything.values(), reverse=True)
        tokens, parents, ranks, probs = grow_best_first(m, root, max_nodes)
        assert probs[1:] == best[:max_nodes]
        chosen = rank_paths(parents, ranks)[1:]
        assert all(everything[p] == q for p, q in zip(chosen, probs[1:]))
        if len(best) <= max_nodes or best[max_nodes - 1] > best[max_nodes]:  # no tie at the cut
            assert set(chosen) == {p for p, q in everything.items() if q >= best[min(max_nodes, len(best)) - 1]}


def test_rows_never_written_are_not_drafted_and_unknown_rows_read_as_the_prior():
    m = AdjacencyMatrix(8, 2, keep_probs=True)
    assert grow_best_first(m, 3, 5) == ([3], [-1], [0], [1.0])  # a cold matrix: the root alone
    m.update(torch.tensor([3]), torch.tensor([[5, 6]]))  # ids without probabilities: the prior, 0.5 and 0.25
    m.update(torch.tensor([5]), torch.tensor([[1, 2]]), probs=torch.tensor([[0.25, 0.125]]))
    assert m.prior() == [0.375, 0.1875]  # the default (0.5, 0.25) and 5's row, one row each
    # from 3 by the prior: 5 (0.375), 6 (0.1875); then 5 -> 1 (0.375 * 0.25), 5 -> 2 (0.375 * 0.125)
    tokens, parents, ranks, probs = grow_best_first(m, 3, 5)
    assert tokens == [3, 5, 6, 1, 2] and parents == [-1, 0, 0, 1, 1]
    assert probs == [1.0, 0.375, 0.1875, 0.375 * 0.25, 0.375 * 0.125]  # 6, 1 and 2's rows were never written
    # a matrix that keeps no probabilities reads as one whose written rows are unknown: the same tree
    plain = AdjacencyMatrix(8, 2)
    assert grow_best_first(plain, 3, 5) == ([3], [-1], [0], [1.0])
    plain.update(torch.tensor([3, 5]), torch.tensor([[5, 6], [1, 2]]))
    assert grow_best_first(plain, 3, 5) == grow_best_first(plain.clone().with_probs(), 3, 5)
    assert grow_best_first(plain, 3, 5)[0] == [3, 5, 6, 1, 2] and plain.probs is None  # reading changed nothing


def outcome(tokens, path, top, probs, forward_ms=10.0, whole=True):
    made = Outcome(tokens, torch.tensor(path), top, None, forward_ms, whole)
    made.__dict__["probs"] = probs  # as if computed: the cached value the drafter reads
    return made


def hand_matrix() -> AdjacencyMatrix:
    """1 -> 2 (0.5), 3 (0.25); 2 -> 4 (0.75), 5 (0.125): best first 2, 4, 3, 5."""
    m = AdjacencyMatrix(VOCAB, 2, keep_probs=True)
    m.update(torch.tensor([1, 2]), torch.tensor([[2, 3], [4, 5]]), probs=torch.tensor([[0.5, 0.25], [0.75, 0.125]]))
    return m


def test_the_drafter_proposes_the_tree_in_bfs_order_and_learns_probabilities():
    m = hand_matrix()
    drafter = DynamicRecyclingDrafter(m, max_nodes=3)
    proposed = drafter.propose(torch.tensor([9, 1]))
    tokens, tree = proposed.tokens, proposed.tree
    # best first: 2 (0.5), 4 (0.375), 3 (0.25); in BFS order root, 2, 3, then 4
    assert tokens.tolist() == [1, 2, 3, 4] and tree.parents.tolist() == [-1, 0, 0, 1]
    assert tree.name == "dynamic" and tree.sources == ("root", "best-first", "best-first", "best-first")
    assert tree.node_paths == ((), (0,), (1,), (0, 0))
    assert drafter.last_path_probs == [1.0, 0.5, 0.25, 0.375] and (proposed.budget, proposed.estimates) == (None, {})
    top = torch.tensor([[2, 7], [4, 6], [8, 9], [1, 2]])
    probs = torch.tensor([[0.5, 0.25], [0.625, 0.25], [0.5, 0.5], [0.75, 0.125]])
    updates = drafter.learn(outcome(tokens, [0, 1, 3], top, probs))
    assert [(u.token, u.old, u.new) for u in updates] == [(1, [2, 3], [2, 7]), (2, [4, 5], [4, 6]),
                                                         (3, [0, 0], [8, 9]), (4, [0, 0], [1, 2])]
    assert m.probs[2].tolist() == [0.625, 0.25] and m.probs[3].tolist() == [0.5, 0.5]
    tokens = drafter.propose(torch.tensor([9, 1])).tokens  # 1 -> 2 (0.5), 2 -> 4 (0.3125), 1 -> 7 (0.25)
    assert tokens.tolist() == [1, 2, 7, 4] and drafter.last_path_probs == [1.0, 0.5, 0.25, 0.3125]


def test_each_step_drafts_the_size_its_path_probabilities_favour_over_the_budgets_step_times():
    # 1 -> 2 (0.5), 2 -> 4 (0.375), 1 -> 3 (0.25): on a flat curve every node pays, on a steep one none
    flat = TreeBudget([1, 4], [10.0, 10.0], [1.0, 0.5, 0.5, 0.5], explore_every=0, acceptance_rate=0.5)
    drafter = DynamicRecyclingDrafter(hand_matrix(), budget=flat)
    proposed = drafter.propose(torch.tensor([1]))
    tokens, tree, n, report = proposed.tokens, proposed.tree, proposed.budget, proposed.estimates
    assert tree.size == 4 and n == 3 and report["chosen_by"] == "path probabilities"
    assert report["expected_tokens"] == [1.0, 2.125] and report["best"] == 3
    steep = TreeBudget([1, 4], [10.0, 40.0], [1.0, 0.5, 0.5, 0.5], explore_every=0)
    assert DynamicRecyclingDrafter(hand_matrix(), budget=steep).propose(torch.tensor([1])).tree.size == 1
    # accepted root -> 2 -> 4 (BFS nodes 0, 1, 3), the budget's own size ran: it learns the places
    drafter.learn(outcome(tokens, [0, 1, 3], torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 2), 20.0))
    assert flat.acceptance == [1.0, 0.75, 0.75, 0.25]
    assert drafter.calibration.factor == pytest.approx((1 + 2) / (1 + 1.125))  # 2 accepted for 1.125
    assert flat.speed > 1  # the step took twice the calibrated time
    # near the context's end the loop verifies the root alone: nothing is learned from that step
    proposed = drafter.propose(torch.tensor([1]))  # rows now all zeros: the root alone
    assert proposed.tree.size == 1 and proposed.budget == 0
    speed, factor = flat.speed, drafter.calibration.factor
    drafter.learn(outcome(torch.tensor([1]), [0], torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2), 99.0,
                          whole=False))
    assert flat.speed == speed and drafter.calibration.factor == factor


def test_choose_size_follows_the_step_time_curve():
    probs = [1.0, 0.9, 0.8, 0.6, 0.3, 0.1]
    assert choose_size(probs, [1, 8], [10.0, 10.0], 1.0) == 6  # free nodes: all of them
    assert choose_size(probs, [1, 8], [10.0, 80.0], 1.0) == 1  # each node costs a whole step: none
    # +1 ms a node: a node pays while its probability beats the tokens per ms so far (3.6 / 14 ms > 3.3 / 13 ms)
    assert choose_size(probs, [1, 8], [10.0, 17.0], 1.0) == 5
    assert choose_size(probs, [1, 8], [10.0, 17.0], 0.1) == 1  # the matrix was ten times too sure: none


def test_the_drafter_has_the_two_verbs_refuses_bad_settings_and_never_changes_a_matrix_when_made():
    drafter = DynamicRecyclingDrafter(AdjacencyMatrix(VOCAB, 5, keep_probs=True), max_nodes=8, seed_from_prompt=True)
    assert (drafter.name, drafter.needs) == ("tr-dynamic", Needs(top_k=5, prefill=True))
    for method in ("propose", "learn"):
        assert (list(inspect.signature(getattr(drafter, method)).parameters)
                == list(inspect.signature(getattr(Drafter, method)).parameters)[1:]), method
    plain = AdjacencyMatrix(VOCAB, 5)
    drafter = DynamicRecyclingDrafter(plain, max_nodes=8)
    assert plain.probs is None  # made: nothing changed; its first lesson makes the matrix keep probabilities
    proposed = drafter.propose(torch.tensor([3]))
    drafter.learn(outcome(proposed.tokens, [0], torch.ones(proposed.tokens.numel(), 5, dtype=torch.long),
                          torch.full((proposed.tokens.numel(), 5), 0.1)))
    assert plain.probs is not None and plain.probs[3].tolist() == [pytest.approx(0.1, rel=1e-3)] * 5
    budget = TreeBudget([1, 3], [10.0, 12.0], [1.0, 0.5, 0.3])
    for kwargs in ({}, {"max_nodes": 8, "budget": budget}):
        with pytest.raises(ValueError, match="either max_nodes or a tree budget"):
            DynamicRecyclingDrafter(AdjacencyMatrix(VOCAB, 5, keep_probs=True), **kwargs)


def dynamic_budget(max_nodes: int = 32, ms_per_node: float = 0.5) -> TreeBudget:
    """A budget over sizes up to ``max_nodes`` draft nodes whose calibrated step time grows by ``ms_per_node``."""
    sizes = candidate_sizes(max_nodes + 1)
    acceptance = [1.0] + [0.6 / j for j in range(1, sizes[-1])]
    return TreeBudget(sizes, [10.0 + ms_per_node * n for n in sizes], acceptance, explore_every=3)


def test_decoding_with_the_dynamic_tree_equals_plain_greedy(tiny):
    arch, model = tiny
    hot = {"fixed": AdjacencyMatrix(VOCAB, 8, keep_probs=True), "budget": AdjacencyMatrix(VOCAB, 8, keep_probs=True)}
    budget = dynamic_budget()
    accepted = {}
    for i, prompt in enumerate(prompts(seed=5)[:6]):
        ref = reference_greedy(model, prompt, NEW_TOKENS)
        drafters = {
            # hot: the matrix (and budget) carry over from earlier prompts
            "fixed-hot": DynamicRecyclingDrafter(hot["fixed"], max_nodes=16),
            "budget-hot": DynamicRecyclingDrafter(hot["budget"], budget=budget),
            "seeded": DynamicRecyclingDrafter(AdjacencyMatrix(VOCAB, 8, keep_probs=True), max_nodes=8 * (i % 3),
                                              seed_from_prompt=True),
        }
        for name, drafter in drafters.items():
            result = run(model, prompt, drafter, NEW_TOKENS)
            assert result.token_ids == ref, f"{arch} {name} differs from plain greedy decoding"
            for e in result.events:
                assert e.method == "tr-dynamic" and e.tree_name == "dynamic"
                assert e.tree_sources == ["root"] + ["best-first"] * (len(e.tree_tokens) - 1)
                assert len(e.tree_tokens) - 1 <= (e.budget if name == "budget-hot" else 16)
            accepted[name] = accepted.get(name, 0) + sum(len(e.accepted_path) - 1 for e in result.events)
    print(arch, "draft tokens accepted:", accepted)
    assert accepted["fixed-hot"] > 0 and accepted["budget-hot"] > 0


def test_long_paths_from_a_hot_start_file_without_probabilities_stay_exact(tiny):
    """An oracle matrix as saved without probabilities (every row unknown: the prior) drafts the real continuation
    (frozen, so that it stays an oracle); with and without a budget, long paths are accepted and stay exact. The
    prior halves per rank: the likeliest 63 nodes reach depth 6."""
    arch, model = tiny
    for make in (lambda m: DynamicRecyclingDrafter(m, max_nodes=63),
                 lambda m: DynamicRecyclingDrafter(m, budget=dynamic_budget(63, ms_per_node=0.0), max_grow=63)):
        longest = 0
        for prompt in prompts(seed=7)[:3]:
            ref = reference_greedy(model, prompt, NEW_TOKENS)
            drafter = make(oracle_matrix(model, prompt, ref).with_probs())
            drafter.learn = lambda outcome: []
            result = run(model, prompt, drafter, NEW_TOKENS)
            assert result.token_ids == ref
            longest = max([longest] + [len(e.accepted_path) - 1 for e in result.events])
        assert longest == 6, f"{arch}: the prior-driven tree never had a whole-depth path accepted"
