"""The drafters: Prompt Lookup's drafts by hand, the protocol the decoding loop relies on, and the stop rule."""

import doctest
import inspect

import pytest
import torch
from conftest import VOCAB, reference_greedy, tiny_model

from tr_core import (
    AdjacencyMatrix,
    PlainDrafter,
    PromptLookupDrafter,
    RecyclingDrafter,
    build_tree,
    decode,
    decoding,
    drafters,
    run,
)
from tr_core.budget import TreeBudget
from tr_core.decoding import stop_rule
from tr_core.drafters import AdaptiveRecyclingDrafter, Drafter, nested_trees


def draft(context: list[int], **kwargs) -> list[int]:
    """Prompt Lookup's proposal after ``context``, checked to be a chain rooted at the last token."""
    tokens, tree = PromptLookupDrafter(**kwargs).propose(torch.tensor(context), context[-1])
    assert tokens.dtype == torch.long and tokens[0] == context[-1]
    assert tree.size == tokens.numel() and tree.parents.tolist() == list(range(-1, tree.size - 1))  # a chain
    return tokens.tolist()


def test_the_longest_ngram_wins_over_a_later_shorter_match():
    context = [4, 2, 3, 5, 6, 3, 7, 4, 2, 3]
    # [4, 2, 3] occurred at 0 (then 5, 6); the unigram [3] occurred later, at 5 (then 7, 4)
    assert draft(context, max_ngram=3, max_draft=2) == [3, 5, 6]
    assert draft(context, max_ngram=1, max_draft=2) == [3, 7, 4]


def test_the_latest_earlier_occurrence_is_copied():
    # [5] occurred at 0 (then 1) and at 2 (then 2, 9, 5): the latest wins
    assert draft([5, 1, 5, 2, 9, 5], max_ngram=1, max_draft=2) == [5, 2, 9]


def test_max_draft_bounds_the_chain():
    context = [5, 6, 7, 8, 9, 10, 11, 5, 6]
    assert draft(context, max_ngram=2, max_draft=3) == [6, 7, 8, 9]
    assert draft(context, max_ngram=2, max_draft=1) == [6, 7]
    assert draft(context, max_ngram=2, max_draft=10) == [6, 7, 8, 9, 10, 11, 5, 6]  # up to the context's end


def test_no_match_proposes_the_root_alone():
    tokens, tree = PromptLookupDrafter().propose(torch.tensor([1, 2, 3, 4]), 4)
    assert tokens.tolist() == [4] and tree.size == 1 and tree.max_depth == 0
    assert draft([1, 2, 3, 4]) == [4]


def test_a_context_shorter_than_n_falls_back_to_shorter_ngrams():
    assert draft([5], max_ngram=3) == [5]  # nothing before the root to match
    assert draft([3, 3], max_ngram=3) == [3, 3]  # n = 3 and 2 do not fit; the unigram at 0 does


def test_a_match_near_the_end_copies_only_what_follows_it():
    assert draft([1, 2, 3, 1, 2], max_ngram=2, max_draft=10) == [2, 3, 1, 2]
    assert draft([8, 8, 8], max_ngram=2, max_draft=10) == [8, 8]  # the match overlaps the n-gram it matches


def test_min_ngram_bounds_the_search():
    assert draft([5, 1, 5], max_ngram=3, min_ngram=1) == [5, 1, 5]
    assert draft([5, 1, 5], max_ngram=3, min_ngram=2) == [5]  # [1, 5] never occurred before; [5] is not tried


@pytest.mark.parametrize("kwargs", [dict(min_ngram=0), dict(max_ngram=2, min_ngram=3), dict(max_draft=0)])
def test_prompt_lookup_refuses_impossible_settings(kwargs):
    with pytest.raises(ValueError, match="prompt lookup needs"):
        PromptLookupDrafter(**kwargs)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_prompt_lookup_drafts_in_a_run_and_stays_exact(arch):
    # a 16-token vocabulary: the tiny random model's greedy output soon repeats itself, as a real model copies
    model = tiny_model(arch, vocab=16)
    prompt = [1, 2, 3, 4, 5, 6, 7] * 3
    result = run(model, prompt, PromptLookupDrafter(), 48)
    assert result.token_ids == reference_greedy(model, prompt, 48) == run(model, prompt, PlainDrafter(), 48).token_ids
    assert max(len(e.new_tokens) for e in result.events) > 1, "prompt lookup never had a draft accepted"
    assert result.steps < len(result.token_ids)
    assert all(e.method == "pld" and e.tree_parents == list(range(-1, len(e.tree_tokens) - 1)) for e in result.events)


def test_every_drafter_declares_what_the_loop_reads():
    recycling = RecyclingDrafter(AdjacencyMatrix(VOCAB, 5), build_tree({"": 2}), seed_from_prompt=True)
    adaptive = AdaptiveRecyclingDrafter(AdjacencyMatrix(VOCAB, 5), nested_trees([(0,), (1,)], [1, 3]),
                                        TreeBudget([1, 3], [10.0, 12.0], [1.0, 0.5, 0.3]))
    expected = {"plain": (PlainDrafter(), 0, False), "pld": (PromptLookupDrafter(), 0, False),
                "tr": (recycling, 5, True), "tr adaptive": (adaptive, 5, False)}
    for name, (drafter, top_k, wants) in expected.items():
        assert (drafter.name, drafter.top_k, drafter.wants_prefill_logits) == (name.split()[0], top_k, wants)
        for method in ("propose", "update", "on_prefill", "observe", "budget_report"):
            assert (list(inspect.signature(getattr(drafter, method)).parameters)
                    == list(inspect.signature(getattr(Drafter, method)).parameters)[1:]), f"{name}.{method}"


@pytest.mark.parametrize("top_k", [0, 1, 3])
def test_the_loop_calls_update_with_each_nodes_top_k(top_k):
    calls = []

    class Recording(PromptLookupDrafter):
        def update(self, tokens, path, top, probs):
            calls.append((tokens.clone(), path.clone(), top))
            return []

    drafter = Recording()
    drafter.top_k = top_k
    model = tiny_model("llama", vocab=16)
    events = list(decode(model, [1, 2, 3, 4, 5, 6, 7] * 3, drafter, 24))
    assert len(calls) == len(events)
    for (tokens, path, top), e in zip(calls, events):
        assert tokens.tolist() == e.tree_tokens and path.tolist() == e.accepted_path
        if top_k == 0:
            assert top is None
        else:
            assert top.shape == (tokens.numel(), top_k) and top[:, 0].tolist() == e.predicted


def test_the_loop_gives_every_drafter_the_forward_time_and_asks_for_its_budget():
    calls = []

    class Recording(PromptLookupDrafter):
        def update(self, tokens, path, top, probs):
            calls.append("update")
            return []

        def observe(self, forward_ms):
            calls.append(forward_ms)

        def budget_report(self):
            calls.append("report")
            return 7, {"sizes": [len(calls)]}

    model = tiny_model("llama", vocab=16)
    events = list(decode(model, [1, 2, 3, 4, 5, 6, 7] * 3, Recording(), 24))
    assert calls == [x for e in events for x in ("report", "update", e.forward_ms)]  # in this order, once a step
    assert all(e.budget == 7 and e.budget_estimates == {"sizes": [3 * e.step + 1]} for e in events)
    # drafters without a budget report none
    for e in decode(model, [1, 2, 3] * 3, PromptLookupDrafter(), 8):
        assert e.budget is None and e.budget_estimates == {}


def test_the_adaptive_drafter_drafts_the_size_its_budget_chose_and_teaches_it():
    order = [(0,), (1,), (0, 0), (2,)]
    nested = nested_trees(order, [1, 3, 5])
    budget = TreeBudget([1, 3, 5], [10.0, 10.0, 10.0], [1.0, 0.5, 0.5, 0.4, 0.4], explore_every=2,
                        acceptance_rate=0.5)
    drafter = AdaptiveRecyclingDrafter(AdjacencyMatrix(VOCAB, 3), nested, budget)
    tokens, tree = drafter.propose(torch.tensor([4, 5]), 5)
    assert tree is drafter.nested.trees[2] and tokens.numel() == 5 and drafter.budget_report()[0] == 4
    # the accepted path root -> (0,) -> (0, 0): in BFS order nodes 0, 1, 3; likeliest first positions 1 and 3
    assert tree.node_paths == ((), (0,), (1,), (2,), (0, 0))
    drafter.update(tokens, torch.tensor([0, 1, 4]), torch.zeros(5, 3, dtype=torch.long))
    assert budget.acceptance == [1.0, 0.75, 0.25, 0.7, 0.2]
    drafter.observe(20.0)
    assert budget.speed > 1  # the step took twice the calibrated time
    tokens, tree = drafter.propose(torch.tensor([4, 5]), 5)  # step 2 explores the size below
    assert tree is drafter.nested.trees[1] and drafter.budget_report()[1]["explored"]
    # near the context's end the loop verifies the root alone: nothing is learned from that step
    drafter.update(tokens[:1], torch.tensor([0]), torch.zeros(1, 3, dtype=torch.long))
    before = (budget.speed, list(budget.correction))
    drafter.observe(99.0)
    assert (budget.speed, budget.correction) == before


def test_stop_rule():
    # EOS first, kept, even where the budget ends at the same token
    assert stop_rule([5, 2, 9], 8, {2}, 20, None) == ([5, 2], "eos")
    assert stop_rule([5, 2, 9], 2, {2}, 20, None) == ([5, 2], "eos")
    # an EOS past the budget is never reached
    assert stop_rule([5, 2, 9], 1, {2}, 20, None) == ([5], "max_new_tokens")
    assert stop_rule([5, 6], 2, set(), 20, None) == ([5, 6], "max_new_tokens")
    # the context: 62 tokens before the step, two new ones fill a model of 64 positions
    assert stop_rule([5, 6], 8, set(), 62, 64) == ([5, 6], "context_full")
    assert stop_rule([5, 6], 8, set(), 61, 64) == ([5, 6], None)
    assert stop_rule([5, 6], 2, set(), 62, 64) == ([5, 6], "max_new_tokens")  # the budget is named first
    assert stop_rule([5], 8, {7}, 20, None) == ([5], None)


@pytest.mark.parametrize("module", [decoding, drafters], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    failed, tried = doctest.testmod(module)
    assert tried and not failed


def test_the_loop_gives_each_nodes_top_k_probabilities_to_a_drafter_that_wants_them():
    calls = []

    class Recording(PromptLookupDrafter):
        wants_probs = True
        top_k = 3

        def update(self, tokens, path, top, probs):
            calls.append(probs)
            return []

    model = tiny_model("llama", vocab=16)
    list(decode(model, [1, 2, 3, 4, 5, 6, 7] * 3, Recording(), 12))
    assert calls and all(p.shape[1] == 3 and p.dtype == torch.float32 for p in calls)
    for probs in calls:
        assert bool((probs[:, :-1] >= probs[:, 1:]).all()) and bool((probs.sum(dim=1) <= 1 + 1e-5).all())
    assert PromptLookupDrafter.wants_probs is False  # the others get None: no softmax over the vocabulary
