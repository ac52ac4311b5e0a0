"""Every method must produce exactly the tokens of plain greedy decoding (float64 tiny models: no near-ties)."""

import dataclasses

import pytest
import torch
from conftest import VOCAB, reference_greedy

from tr_core import AdjacencyMatrix, PlainDrafter, PromptLookupDrafter, RecyclingDrafter, load_template, run
from tr_core.budget import TreeBudget, candidate_sizes
from tr_core.drafters import AdaptiveRecyclingDrafter, nested_trees

N_PROMPTS, NEW_TOKENS = 12, 64


def prompts(seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(N_PROMPTS):
        length = int(torch.randint(4, 40, (1,), generator=g))
        ids = torch.randint(0, VOCAB, (length,), generator=g)
        if i % 2:  # half the prompts repeat a span, so that prompt lookup finds matches
            ids = torch.cat([ids, ids[: length // 2]])
        out.append(ids.tolist())
    return out


@pytest.mark.slow
def test_all_methods_equal_plain_greedy(tiny):
    arch, model = tiny
    hot = {name: AdjacencyMatrix(VOCAB, 8) for name in ("paper", "small")}
    stats = {}
    for prompt in prompts(seed=len(arch)):
        ref = reference_greedy(model, prompt, NEW_TOKENS)
        drafters = {
            "plain": PlainDrafter(),
            "pld": PromptLookupDrafter(),
            # hot: the matrix carries over from earlier prompts; cold: a fresh, empty matrix each time
            "tr-paper-hot": RecyclingDrafter(hot["paper"], load_template("paper")),
            "tr-small-hot": RecyclingDrafter(hot["small"], load_template("small")),
            "tr-paper-cold": RecyclingDrafter(AdjacencyMatrix(VOCAB, 8), load_template("paper")),
            "tr-small-cold": RecyclingDrafter(AdjacencyMatrix(VOCAB, 8), load_template("small")),
            "tr-paper-seeded": RecyclingDrafter(AdjacencyMatrix(VOCAB, 8), load_template("paper"), True),
        }
        for name, drafter in drafters.items():
            result = run(model, prompt, drafter, NEW_TOKENS)
            assert result.token_ids == ref, f"{arch} {name} differs from plain greedy decoding"
            s = stats.setdefault(name, [0, 0])
            s[0] += len(result.token_ids)
            s[1] += result.steps
    assert stats["plain"][0] == stats["plain"][1]  # plain: one token per forward
    print(arch, {k: round(t / s, 2) for k, (t, s) in stats.items()})


def oracle_matrix(model, prompt, ref, k=8, seed=0):
    """A matrix whose rows list each token's successors in the reference continuation (most frequent first),
    the remaining ranks random: drafts along the real continuation are in the tree, so long paths are accepted."""
    g = torch.Generator().manual_seed(seed)
    m = AdjacencyMatrix(VOCAB, k)
    m.rows.copy_(torch.randint(0, VOCAB, (VOCAB, k), generator=g, dtype=torch.int32))
    seq = prompt[-1:] + ref
    successors: dict[int, dict[int, int]] = {}
    for a, b in zip(seq, seq[1:]):
        successors.setdefault(a, {}).setdefault(b, 0)
        successors[a][b] += 1
    for a, counts in successors.items():
        ranked = sorted(counts, key=lambda b: -counts[b])[:k]
        m.rows[a, : len(ranked)] = torch.tensor(ranked, dtype=torch.int32)
    return m


@pytest.mark.parametrize("tree", ["paper", "small", "chain4"])
def test_long_accepted_paths_stay_exact(tiny, tree):
    arch, model = tiny
    total_tokens = total_steps = longest = 0
    for prompt in prompts(seed=7)[:6]:
        ref = reference_greedy(model, prompt, NEW_TOKENS)
        drafter = RecyclingDrafter(oracle_matrix(model, prompt, ref), load_template(tree))
        # The update overwrites rows as it goes; freeze them so the oracle stays an oracle for this test.
        drafter.learn = lambda outcome: []
        result = run(model, prompt, drafter, NEW_TOKENS)
        assert result.token_ids == ref
        total_tokens += len(result.token_ids)
        total_steps += result.steps
        longest = max([longest] + [len(e.accepted_path) - 1 for e in result.events])
    mat = total_tokens / total_steps
    print(arch, tree, "mean accepted tokens with an oracle matrix:", round(mat, 2), "longest path:", longest)
    assert longest == load_template(tree).max_depth  # whole-depth paths were accepted, and stayed exact
    assert mat > 1.5


def test_stops_exactly_at_eos_and_budget(tiny):
    arch, model = tiny
    prompt = prompts(seed=3)[0]
    ref = reference_greedy(model, prompt, NEW_TOKENS)
    eos = ref[20]
    cut = ref.index(eos) + 1
    for drafter in (PlainDrafter(), PromptLookupDrafter(),
                    RecyclingDrafter(oracle_matrix(model, prompt, ref), load_template("paper"))):
        result = run(model, prompt, drafter, NEW_TOKENS, eos_ids={eos})
        assert result.token_ids == ref[:cut] and result.stop_reason == "eos"
        for budget in (1, 5, 17):
            result = run(model, prompt, drafter, budget, eos_ids={eos})
            want = ref[:min(budget, cut)]
            assert result.token_ids == want
            assert result.stop_reason == ("eos" if cut <= budget else "max_new_tokens")


def test_context_limit_is_respected():
    from conftest import tiny_model

    model = tiny_model("gpt2")
    model.config.n_positions = model.config.max_position_embeddings = 60
    prompt = list(range(40))
    result = run(model, prompt, RecyclingDrafter(AdjacencyMatrix(VOCAB, 8), load_template("paper")), 100)
    assert result.stop_reason == "context_full"
    assert len(prompt) + len(result.token_ids) <= 60
    assert result.token_ids == reference_greedy(model, prompt, len(result.token_ids))
    with pytest.raises(ValueError, match="at most 59"):
        run(model, list(range(60)), PlainDrafter(), 4)


class StubTimed(AdaptiveRecyclingDrafter):
    """An adaptive drafter whose budget sees simulated step times (ms) instead of the tiny model's: until step 40
    large trees are dear, then cheap, so the size changes during the run whatever the machine."""

    def learn(self, outcome):
        if not outcome.is_prompt:
            n, step = self.tree.size, self.budget.steps
            outcome = dataclasses.replace(outcome, forward_ms=10 + (2.0 if step < 40 else 0.02) * n)
        return super().learn(outcome)


def adaptive_drafter(matrix, explore_every=3):
    paper = load_template("paper")  # its nodes in BFS order stand for likeliest first here
    sizes = candidate_sizes(paper.size)
    acceptance = [1.0] + [0.7 ** len(p) for p in paper.node_paths[1:]]
    budget = TreeBudget(sizes, [10.0 + 0.5 * n for n in sizes], acceptance, explore_every=explore_every)
    return StubTimed(matrix, nested_trees(list(paper.node_paths[1:]), sizes), budget)


def test_a_tree_that_changes_size_during_the_run_stays_exact(tiny):
    arch, model = tiny
    matrix, budgets = AdjacencyMatrix(VOCAB, 8), set()
    drafter = adaptive_drafter(matrix)
    for prompt in prompts(seed=11)[:4]:
        ref = reference_greedy(model, prompt, NEW_TOKENS)
        result = run(model, prompt, drafter, NEW_TOKENS)  # one budget and matrix across prompts: hot start
        assert result.token_ids == ref, f"{arch}: the adaptive tree differs from plain greedy decoding"
        for e in result.events:
            assert e.budget == len(e.tree_tokens) - 1 and e.method == "tr"
            assert e.budget_estimates["explored"] == (e.budget != e.budget_estimates["best"])
        budgets.update(e.budget for e in result.events)
    assert len(budgets) >= 4, f"the size hardly changed: {sorted(budgets)}"
    # with an oracle matrix (frozen), long paths are accepted in trees of changing size, and stay exact
    prompt = prompts(seed=7)[0]
    ref = reference_greedy(model, prompt, NEW_TOKENS)
    drafter = adaptive_drafter(oracle_matrix(model, prompt, ref), explore_every=2)
    drafter.learn = lambda outcome: []
    result = run(model, prompt, drafter, NEW_TOKENS)
    assert result.token_ids == ref and max(len(e.accepted_path) for e in result.events) > 3
