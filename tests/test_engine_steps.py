"""Hand-checked single steps: matrix update, cache compaction, and the events' account of a step."""

import json

import pytest
import torch
from conftest import VOCAB, tiny_model
from transformers import DynamicCache

from tr_core import AdjacencyMatrix, RecyclingDrafter, StepEvent, build_tree, decode
from tr_core.speed.backend import tree_mask
from tr_core.speed.kv import keep_accepted_path

PROMPT = [11, 42, 7, 99, 3, 250, 18]


def logits_from_scratch(model, ids):
    """Next-token logits after ``ids``: a plain forward over the whole sequence, no cache, no tree."""
    return model(input_ids=torch.tensor([ids])).logits[0, -1]


def distinct_matrix(k=3):
    # every row holds distinct tokens, and the small tree below never draws a token twice
    m = AdjacencyMatrix(VOCAB, k)
    for t in range(VOCAB):
        m.rows[t] = torch.tensor([(t * 7 + 1 + r * 31) % VOCAB for r in range(k)], dtype=torch.int32)
    return m


def test_rows_after_one_step_equal_topk_of_each_nodes_logits():
    model = tiny_model("llama", seed=1)
    tree = build_tree({"": 3, "0": 2, "1": 1, "00": 1})
    m = distinct_matrix()
    event = next(decode(model, PROMPT, RecyclingDrafter(m, tree), max_new_tokens=32))
    tokens = event.tree_tokens
    assert len(set(tokens)) == len(tokens)
    for i, path in enumerate(tree.node_paths):
        # ids from the root down to node i
        chain, j = [], i
        while j >= 0:
            chain.append(tokens[j])
            j = event.tree_parents[j]
        ids = PROMPT[:-1] + chain[::-1]
        want = torch.topk(logits_from_scratch(model, ids), m.k).indices.tolist()
        assert m.rows[tokens[i]].tolist() == want, f"row of node {i} {path}"
        assert event.predicted[i] == want[0]
    updated = {r.token: r for r in event.rows_updated}
    assert sorted(updated) == sorted(tokens)
    assert all(updated[t].new == m.rows[t].tolist() for t in tokens)
    # the new tokens are the accepted drafts plus the bonus token, and the bonus is the model's choice
    path = event.accepted_path
    assert event.new_tokens == [tokens[n] for n in path[1:]] + [event.bonus_token]
    assert event.bonus_token == event.predicted[path[-1]]
    assert all(tokens[c] == event.predicted[p] for p, c in zip(path, path[1:]))


def test_cache_after_compaction_matches_a_forward_from_scratch():
    model = tiny_model("qwen2", seed=2)
    tree = build_tree({"": 3, "0": 2, "1": 2, "10": 1})
    tokens = torch.tensor([PROMPT[-1], 5, 6, 7, 8, 9, 10, 12, 13])
    assert tokens.numel() == tree.size
    for path in ([0], [0, 2], [0, 2, 6], [0, 2, 6, 8], [0, 1, 4], [0, 3]):
        cache = DynamicCache(config=model.config)
        past = len(PROMPT) - 1
        model(input_ids=torch.tensor([PROMPT[:-1]]), cache=cache, use_cache=True)
        model(input_ids=tokens[None], position_ids=(past + tree.depth)[None],
              attention_mask=tree_mask(tree, past, model.dtype, model.device), cache=cache, use_cache=True)
        keep_accepted_path(cache, past, tree.size, torch.tensor(path))
        assert cache.get_seq_length() == past + len(path)
        kept = tokens[path].tolist()
        nxt = 77
        got = model(input_ids=torch.tensor([[nxt]]), position_ids=torch.tensor([[past + len(path)]]),
                    cache=cache, use_cache=True).logits[0, -1]
        want = logits_from_scratch(model, PROMPT[:-1] + kept + [nxt])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_events_survive_a_json_round_trip():
    model = tiny_model("gpt2", seed=3)
    events = list(decode(model, PROMPT, RecyclingDrafter(distinct_matrix(8), build_tree({"": 4, "0": 2})), 16))
    assert events[-1].finished and events[-1].total_tokens == 16
    for e in events:
        back = StepEvent.from_dict(json.loads(json.dumps(e.to_dict())))
        assert back == e
    assert all(isinstance(r.old, list) and len(r.new) == 8 for r in events[0].rows_updated)


def test_budget_fields_survive_a_json_round_trip_and_old_traces_still_load():
    from tr_core.budget import TreeBudget
    from tr_core.drafters import AdaptiveRecyclingDrafter, nested_trees

    model = tiny_model("llama", seed=3)
    nested = nested_trees([(0,), (1,), (0, 0)], [1, 2, 4])
    budget = TreeBudget([1, 2, 4], [10.0, 11.0, 12.0], [1.0, 0.6, 0.3, 0.3], explore_every=3)
    events = list(decode(model, PROMPT, AdaptiveRecyclingDrafter(distinct_matrix(8), nested, budget), 16))
    for e in events:
        assert e.budget == len(e.tree_tokens) - 1 and e.budget_estimates["sizes"] == [0, 1, 3]
        assert StepEvent.from_dict(json.loads(json.dumps(e.to_dict()))) == e
    old = events[0].to_dict()
    del old["budget"], old["budget_estimates"]  # a trace recorded before the budget existed
    back = StepEvent.from_dict(old)
    assert back.budget is None and back.budget_estimates == {} and back.tree_tokens == events[0].tree_tokens


def test_prompt_seeding_fills_each_distinct_prompt_token_once_from_its_last_occurrence():
    from tr_core.decoding import _last_occurrences
    assert _last_occurrences(torch.tensor([5, 3, 5, 7])).tolist() == [1, 2, 3]
    model = tiny_model("llama", seed=1)
    prompt = [11, 42, 7, 11, 3, 42, 11, 18]  # 11 and 42 repeat; the last token is the first step's root
    seen = []

    class Recording(RecyclingDrafter):
        def learn(self, outcome):
            if outcome.is_prompt:
                seen.append((outcome.tokens.clone(), outcome.logits.clone()))
            return super().learn(outcome)

    matrix = AdjacencyMatrix(VOCAB, 3)
    drafter = Recording(matrix, build_tree([], name="root"), seed_from_prompt=True)
    next(decode(model, prompt, drafter, 1))
    ids = torch.cat([i for i, _ in seen]).tolist()
    assert sorted(ids) == sorted(set(prompt[:-1])) == [3, 7, 11, 42]  # each distinct token once
    full = model(input_ids=torch.tensor([prompt[:-1]])).logits[0]
    logits = torch.cat([x for _, x in seen])
    for row, token in enumerate(ids):
        last = max(j for j, t in enumerate(prompt[:-1]) if t == token)
        torch.testing.assert_close(logits[row], full[last])
        assert matrix.rows[token].tolist() == torch.topk(full[last], 3).indices.tolist()


def test_greedy_choice_from_top_k_is_argmax_even_on_ties():
    from tr_core.decoding import greedy_and_top_k
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    logits[1, [7, 3, 40]] = 9.0  # a three-way tie at the top: argmax takes the lowest id, 3
    logits[4, [20, 11]] = 9.0
    predicted, top = greedy_and_top_k(logits, 4)
    assert torch.equal(predicted, logits.argmax(dim=-1)) and predicted[1] == 3 and predicted[4] == 11
    assert torch.equal(top, torch.topk(logits, 4, dim=-1).indices)
    assert greedy_and_top_k(logits, 0)[1] is None and torch.equal(greedy_and_top_k(logits, 0)[0], predicted)
    assert torch.equal(greedy_and_top_k(logits, 1)[0], predicted)


def test_accept_takes_the_longest_agreeing_path_and_the_first_on_a_tie():
    from tr_core.decoding import accept

    tree = build_tree([(0,), (1,), (0, 0), (1, 0)])  # nodes: 0 root, 1 = (0,), 2 = (1,), 3 = (0, 0), 4 = (1, 0)
    tokens = torch.tensor([5, 6, 7, 8, 9])
    # the model predicts 6 after the root, 8 after node 1: the path 0 -> 1 -> 3 agrees twice
    assert accept(tokens, torch.tensor([6, 8, 0, 0, 0]), tree).tolist() == [0, 1, 3]
    # 7 after the root: only node 2 agrees, then 9 after it: 0 -> 2 -> 4
    assert accept(tokens, torch.tensor([7, 0, 9, 0, 0]), tree).tolist() == [0, 2, 4]
    # nothing agrees: the root alone
    assert accept(tokens, torch.tensor([1, 1, 1, 1, 1]), tree).tolist() == [0]
    # two paths agree once each (a tree may hold the same token twice): the first in leaf order wins
    twice = torch.tensor([5, 6, 6, 8, 9])
    assert accept(twice, torch.tensor([6, 0, 0, 0, 0]), tree).tolist() == [0, 1]
    assert accept(tokens[:1], torch.tensor([6]), build_tree([])).tolist() == [0]


def test_the_auto_tree_adapts_and_the_engine_keeps_its_budget(monkeypatch, tmp_path, tiny_folder):
    """"auto" with acceptance statistics -> the adaptive drafter, started at the fitted size; "auto-N" stays fixed.
    Engines of one config share the budget; another config gets its own."""
    from tr_core import engine as engine_module
    from tr_core import load_template
    from tr_core.drafters import AdaptiveRecyclingDrafter
    from tr_core.engine import Engine, EngineConfig
    from tr_core.fitting import fit_tree

    paper = load_template("paper")
    acc = [1.0] * paper.size  # a child never likelier than its parent
    for i in range(1, paper.size):
        acc[i] = acc[int(paper.parents[i])] * 0.6 / (1 + int(paper.ranks[i]))
    (tmp_path / "stats.json").write_text(json.dumps({"node_paths": [list(p) for p in paper.node_paths],
                                                     "acceptance": acc}))
    curve = {1: 10.0, 4: 11.0, 8: 14.0, 16: 24.0, 81: 120.0}

    def auto_tree(model, size=None, context=None, **given):
        return fit_tree(paper, acc, curve, name="auto" if size is None else f"auto-{size}", size=size)

    monkeypatch.setattr(engine_module, "has_acceptance_stats", lambda model: True)
    monkeypatch.setattr(engine_module, "auto_tree", auto_tree)
    monkeypatch.setattr(engine_module, "acceptance_path", lambda slug: tmp_path / "stats.json")
    folder, _, _ = tiny_folder
    engine = Engine.load(str(folder), EngineConfig(method="tr", tree="auto", matrix_path=None))
    fitted = engine.fitted.tree.size
    assert engine.budget.sizes[engine.budget.best] == fitted and fitted in engine.nested.sizes
    assert engine.budget.calibrated[engine.budget.sizes.index(4)] == 11.0
    assert isinstance(engine.drafter(), AdaptiveRecyclingDrafter)
    run = engine.with_matrix(engine.fresh_matrix())
    assert run.budget is engine.budget and engine.with_config().budget is engine.budget
    assert engine.with_config(seed_from_prompt=False).budget is not engine.budget
    result = run.generate([5, 6, 7, 8], 12)
    assert result.events[0].budget == fitted - 1 and engine.budget.steps == result.steps
    fixed = engine.with_config(tree="auto-4")
    assert fixed.budget is None and type(fixed.drafter()).__name__ == "RecyclingDrafter" and fixed.tree.size == 4
    assert all(e.budget is None and len(e.tree_tokens) == 4 for e in fixed.generate([5, 6, 7, 8], 6).events)


@pytest.mark.parametrize("method", ["suffix", "tr-context", "tr-dynamic", "tr-plus"])
def test_every_method_beyond_the_paper_runs_on_a_model_without_acceptance_statistics(tiny_folder, method):
    # no shipped statistics for a tiny model: the methods size their trees on the fallback tree, at one size
    _, model, tokenizer = tiny_folder
    from tr_core.engine import Engine, EngineConfig
    engine = Engine(model, tokenizer, EngineConfig(method=method, tree="auto"))
    prompt = [5, 6, 7, 8, 9] * 4
    want = engine.generate(prompt, 16, method="plain").token_ids
    result = engine.generate(prompt, 16)
    assert result.token_ids == want and all(e.method == method for e in result.events)
    if method != "suffix":
        assert engine.learners.budgets[method].sizes == (1, engine.tree.size)  # the root alone, or the fallback tree
