"""The tree budget adapted online: on simulated cost curves and acceptance (seeded, so every run is the same), it
settles on the size with the most tokens per second, and moves when the curve changes."""

import json
import random

import pytest

from tr_core import load_template
from tr_core.budget import TreeBudget, candidate_sizes, likeliest_first
from tr_core.drafters import nested_trees
from tr_core.fitting import fit_tree

P = [1.0] + [0.6 * 0.8 ** (j - 1) for j in range(1, 81)]  # acceptance of the j-th likeliest node
SIZES = candidate_sizes(81)


def mid(n):
    return 10 + 0.3 * n


def steep(n):  # large trees dearer
    return 10 + 1.0 * n


def flat(n):  # large trees cheaper
    return 10 + 0.1 * n


def true_rates(curve) -> dict[int, float]:
    """Tokens per ms at every candidate size under the simulated truth."""
    return {n: sum(P[:n]) / curve(n) for n in SIZES}


def near_best(curve, within=0.03) -> set[int]:
    rates = true_rates(curve)
    top = max(rates.values())
    return {n for n, r in rates.items() if r >= (1 - within) * top}


def simulate(budget, curve, steps, rng):
    """``steps`` steps: each chosen size's nodes accepted with probability P, its time the curve +-5%."""
    sizes = []
    for _ in range(steps):
        n = budget.choose()
        budget.observe_path([j for j in range(1, n) if rng.random() < P[j]])
        budget.observe_time(curve(n) * (1 + rng.uniform(-0.05, 0.05)))
        sizes.append((n, budget.exploring))
    return sizes


def efficiency(sizes, curve) -> float:
    """The run's tokens per ms against always running the truly best size (exploration steps included)."""
    rates = true_rates(curve)
    return sum(rates[n] for n, _ in sizes) / len(sizes) / max(rates.values())


def budget_on(curve, **kwargs):
    return TreeBudget(SIZES, [curve(n) for n in SIZES], P, **kwargs)


def test_it_converges_to_the_best_size_from_a_wrong_calibration():
    rng = random.Random(0)
    budget = budget_on(flat)  # the calibration says large trees are nearly free
    assert budget.sizes[budget.best] not in near_best(steep)
    sizes = simulate(budget, steep, 600, rng)
    assert budget.sizes[budget.best] in near_best(steep)
    assert efficiency(sizes[200:], steep) > 0.97


@pytest.mark.parametrize("spell, direction", [(steep, -1), (flat, +1)], ids=["dearer", "cheaper"])
def test_it_moves_when_a_slow_spell_changes_the_curve(spell, direction):
    rng = random.Random(1)
    budget = budget_on(mid)
    simulate(budget, mid, 300, rng)
    before = budget.sizes[budget.best]
    assert before in near_best(mid)
    sizes = simulate(budget, spell, 600, rng)
    after = budget.sizes[budget.best]
    assert after in near_best(spell) and (after - before) * direction > 0
    assert efficiency(sizes[300:], spell) > 0.97


def test_a_uniform_slow_spell_seen_at_one_size_moves_every_size():
    budget = budget_on(mid, explore_every=0)
    chosen = budget.choose()
    for _ in range(80):
        budget.observe_time(2.5 * mid(chosen))
        assert budget.choose() == chosen  # the same factor for every size: the best stays the best
    assert budget.step_ms() == pytest.approx([2.5 * mid(n) for n in SIZES], rel=1e-3)
    assert budget.speed == pytest.approx(2.5, rel=1e-3)


def test_an_explored_size_corrects_the_curve_around_it():
    # tokens per step 1, 1.5, 1.7, 2.1 over 10, 10, 20, 40 ms: 2 nodes are best
    budget = TreeBudget([1, 2, 4, 8], [10.0, 10.0, 20.0, 40.0], [1.0, 0.5] + [0.1] * 6, explore_every=2,
                        shape_rate=1.0)
    assert budget.choose() == 2 and not budget.exploring
    budget.observe_time(10.0)
    assert budget.choose() == 4 and budget.exploring  # step 2: the neighbour above
    budget.observe_time(30.0)  # 4 nodes cost 1.5x what the calibration said
    # 8 nodes, never measured, take 4's correction (flat beyond the measured sizes); 1 node takes 2's
    assert budget.step_ms() == pytest.approx([10.0, 10.0, 30.0, 60.0])
    budget.choose()
    budget.choose()
    assert budget.exploring and budget.sizes[budget.current] == 1  # step 4: the neighbour below
    budget.observe_time(5.0)
    assert budget.step_ms() == pytest.approx([5.0, 10.0, 30.0, 60.0])
    budget.observe_time(40.0)  # an 8x surprise moves a correction by 2x at most: one stalled step cannot swing it
    assert budget.step_ms()[0] == pytest.approx(10.0)


def test_acceptance_follows_the_accepted_paths():
    budget = TreeBudget([1, 4], [10.0, 10.0], [1.0, 0.5, 0.5, 0.5], explore_every=0, acceptance_rate=0.1)
    assert budget.choose() == 4
    for _ in range(100):
        budget.observe_path([1, 2])  # the two likeliest nodes always on the path, the third never
    assert budget.acceptance == pytest.approx([1.0, 1.0, 1.0, 0.0], abs=1e-4)
    assert budget.estimates()["expected_tokens"][-1] == pytest.approx(2.5)  # what the choice was made from
    budget.choose()
    assert budget.estimates()["expected_tokens"][-1] == pytest.approx(3.0, abs=1e-3)


def test_the_exploration_schedule_is_fixed():
    budget = budget_on(mid, explore_every=4)
    best = budget.sizes.index(budget.sizes[budget.best])
    runs = []
    for _ in range(12):
        runs.append((budget.choose(), budget.exploring))
        budget.observe_time(mid(runs[-1][0]))
    assert [e for _, e in runs] == [False, False, False, True] * 3
    assert [n for n, e in runs if e] == [SIZES[best + 1], SIZES[best - 1], SIZES[best + 1]]
    # at the smallest size the only neighbour is the next one up
    low = TreeBudget([1, 2], [10.0, 30.0], [1.0, 0.1], explore_every=1)
    assert [low.choose() for _ in range(3)] == [2, 2, 2]
    # the same timings give the same sizes
    again = [simulate(budget_on(flat), steep, 200, random.Random(5)) for _ in range(2)]
    assert again[0] == again[1]


def test_estimates_are_plain_data_in_draft_nodes():
    budget = budget_on(mid)
    budget.choose()
    est = budget.estimates()
    assert json.loads(json.dumps(est)) == est
    assert est["sizes"] == [n - 1 for n in SIZES] and len(est["tokens_per_s"]) == len(SIZES)
    i = est["sizes"].index(est["best"])
    assert est["tokens_per_s"][i] == max(est["tokens_per_s"])
    assert est["tokens_per_s"][i] == pytest.approx(1e3 * est["expected_tokens"][i] / est["step_ms"][i], rel=1e-3)


def test_the_likeliest_first_trees_are_the_fitted_trees():
    paper = load_template("paper")
    acc = [1.0] + [1 / (1 + i + 3 * len(p)) for i, p in enumerate(paper.node_paths[1:])]
    order = likeliest_first(acc)
    nested = nested_trees([paper.node_paths[i] for i in order[1:]], [1, 3, 9, 81])
    for n, tree in zip(nested.sizes, nested.trees):
        fitted = fit_tree(paper, acc, {1: 10.0, 81: 20.0}, size=n).tree
        assert tree.node_paths == fitted.node_paths
    # each node's position in the order, for the acceptance the budget learns
    big, where = nested.trees[-1], nested.positions[-1]
    assert all(order[where[i]] == paper.node_paths.index(p) for i, p in enumerate(big.node_paths))


def test_bad_budgets_are_refused():
    with pytest.raises(ValueError, match="ascending"):
        TreeBudget([2, 1], [1.0, 1.0], [1.0, 0.5])
    with pytest.raises(ValueError, match="step time"):
        TreeBudget([1, 2], [1.0], [1.0, 0.5])
    with pytest.raises(ValueError, match="acceptance covers"):
        TreeBudget([1, 4], [1.0, 2.0], [1.0, 0.5])


# --- the figure ------------------------------------------------------------------------------------------------------

def budget_event(step: int, budget: TreeBudget):
    """A step event carrying the budget's choice, as the decoding loop builds it (the tree itself left out)."""
    from tr_core.events import StepEvent

    n = budget.choose()
    return StepEvent(step=step, method="tr", tree_name="auto", tree_tokens=[1] * n, tree_parents=[-1] * n,
                     tree_ranks=[0] * n, tree_text=[""] * n, predicted=[0] * n, accepted_path=[0], bonus_token=0,
                     new_tokens=[0], new_text="", budget=n - 1, budget_estimates=budget.estimates())


def test_the_budget_figure_holds_the_estimates_and_marks_the_choice():
    from visualize import budget_figure
    from visualize.budget_fig import BEST, CHOSEN, EXPLORED

    budget = budget_on(mid, explore_every=2)
    event = budget_event(12, budget)
    est = event.budget_estimates
    fig = budget_figure(event)
    line, chosen = fig.data
    assert list(line.x) == est["sizes"] and list(line.y) == est["tokens_per_s"]
    assert [tuple(c) for c in line.customdata] == list(zip(est["step_ms"], est["expected_tokens"]))
    best = max(range(len(line.y)), key=lambda i: line.y[i])
    assert chosen.name == CHOSEN and list(chosen.x) == [line.x[best]] == [event.budget]
    assert fig.layout.title.text.replace("<br>", " ") == (
        f"step 12: {event.budget} draft nodes, the most expected tokens/s "
        f"({max(line.y):.1f}) at the step times measured so far")
    explored = budget_event(13, budget)  # every second step tries the neighbour above
    line, best_mark, tried = budget_figure(explored).data
    assert (best_mark.name, tried.name) == (BEST, EXPLORED) and best_mark.marker.symbol != tried.marker.symbol
    assert list(best_mark.x) == [event.budget] and list(tried.x) == [explored.budget] != [event.budget]
    assert list(tried.y) == [line.y[list(line.x).index(explored.budget)]]
    assert "tried beside the best" in budget_figure(explored).layout.title.text.replace("<br>", " ")


def test_the_budget_figure_of_a_step_without_a_budget_says_so():
    from tr_core.events import StepEvent
    from visualize import budget_figure

    event = StepEvent(step=3, method="pld", tree_name="chain", tree_tokens=[1], tree_parents=[-1], tree_ranks=[0],
                      tree_text=[""], predicted=[2], accepted_path=[0], bonus_token=2, new_tokens=[2], new_text="")
    fig = budget_figure(event)
    assert not fig.data and fig.layout.title.text.startswith("step 3: no tree budget")


def test_the_budget_figure_of_a_best_first_step_with_a_context_branch_marks_a_size_between_candidates():
    from tr_core.events import StepEvent
    from visualize import budget_figure

    est = {"sizes": [0, 2, 4], "step_ms": [10.0, 11.0, 13.0], "expected_tokens": [1.0, 1.8, 2.2],
           "tokens_per_s": [100.0, 163.6, 169.2], "best": 3, "explored": False, "speed": 1.0,
           "chosen_by": "path probabilities", "calibration": 0.8, "context_branch": 2, "match": 5, "matrix_nodes": 3}
    n = 6
    event = StepEvent(step=7, method="tr-plus", tree_name="tr-plus", tree_tokens=[1] * n, tree_parents=[-1] * n,
                      tree_ranks=[0] * n, tree_text=[""] * n, predicted=[0] * n, accepted_path=[0], bonus_token=0,
                      new_tokens=[0], new_text="", budget=5, budget_estimates=est)
    fig = budget_figure(event)
    line, chosen = fig.data
    assert list(chosen.x) == [3] and chosen.y[0] == pytest.approx((163.6 + 169.2) / 2)  # between 2 and 4 nodes
    title = fig.layout.title.text.replace("<br>", " ")
    assert title.startswith("step 7: 5 draft nodes (3 from the matrix + 2 from the context)")
    assert "own path probabilities (x0.80" in title
