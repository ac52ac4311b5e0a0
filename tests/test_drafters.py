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
from tr_core.drafters import AdaptiveRecyclingDrafter, Draft, Drafter, Needs, Outcome, nested_trees


def draft(context: list[int], **kwargs) -> list[int]:
    """Prompt Lookup's proposal after ``context``, checked to be a chain rooted at the last token."""
    proposed = PromptLookupDrafter(**kwargs).propose(torch.tensor(context))
    tokens, tree = proposed.tokens, proposed.tree
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
    proposed = PromptLookupDrafter().propose(torch.tensor([1, 2, 3, 4]))
    assert proposed.tokens.tolist() == [4] and proposed.tree.size == 1 and proposed.tree.max_depth == 0
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


def test_every_drafter_has_two_verbs_and_declares_what_it_learns_from():
    recycling = RecyclingDrafter(AdjacencyMatrix(VOCAB, 5), build_tree({"": 2}), seed_from_prompt=True)
    adaptive = AdaptiveRecyclingDrafter(AdjacencyMatrix(VOCAB, 5), nested_trees([(0,), (1,)], [1, 3]),
                                        TreeBudget([1, 3], [10.0, 12.0], [1.0, 0.5, 0.3]))
    expected = {"plain": (PlainDrafter(), Needs()), "pld": (PromptLookupDrafter(), Needs()),
                "tr": (recycling, Needs(top_k=5, prefill=True)), "tr adaptive": (adaptive, Needs(top_k=5))}
    for name, (drafter, needs) in expected.items():
        assert (drafter.name, drafter.needs) == (name.split()[0], needs)
        for method in ("propose", "learn"):
            assert (list(inspect.signature(getattr(drafter, method)).parameters)
                    == list(inspect.signature(getattr(Drafter, method)).parameters)[1:]), f"{name}.{method}"


class Repeater:
    """A drafter written from the README's description of the two verbs alone: it guesses that the last token
    repeats twice, and learns how often that was right."""

    name = "repeat"
    needs = Needs()

    def __init__(self):
        self.steps = self.accepted = 0

    def propose(self, context):
        return Draft(context[-1:].repeat(3), build_tree([(0,), (0, 0)]))

    def learn(self, outcome):
        if outcome.path is not None:
            self.steps += 1
            self.accepted += outcome.path.numel() - 1
        return []


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_drafter_written_from_the_two_verbs_works_with_the_loop(arch):
    model = tiny_model(arch, vocab=16)
    prompt = [3, 3, 3, 5, 5, 5, 7, 7] * 2
    drafter = Repeater()
    result = run(model, prompt, drafter, 32)
    assert result.token_ids == reference_greedy(model, prompt, 32)
    assert drafter.steps == result.steps and all(e.method == "repeat" for e in result.events)
    assert drafter.accepted == sum(len(e.accepted_path) - 1 for e in result.events)


@pytest.mark.parametrize("top_k", [0, 1, 3])
def test_the_loop_hands_learn_each_nodes_top_k_and_the_forward_time(top_k):
    calls = []

    class Recording(PromptLookupDrafter):
        needs = Needs(top_k=top_k)

        def learn(self, outcome):
            calls.append(outcome)
            return []

    model = tiny_model("llama", vocab=16)
    events = list(decode(model, [1, 2, 3, 4, 5, 6, 7] * 3, Recording(), 24))
    assert len(calls) == len(events)  # once a step (no prompt outcome: the drafter does not ask for it)
    for outcome, e in zip(calls, events):
        assert outcome.tokens.tolist() == e.tree_tokens and outcome.path.tolist() == e.accepted_path
        assert outcome.forward_ms == e.forward_ms and outcome.whole
        if top_k == 0:
            assert outcome.top is None and outcome.probs is None
        else:
            assert outcome.top.shape == (outcome.tokens.numel(), top_k) and outcome.top[:, 0].tolist() == e.predicted
            probs = outcome.probs  # of each node's best tokens, best first
            assert probs.shape == outcome.top.shape and bool((probs[:, :-1] >= probs[:, 1:]).all())


def test_a_drafter_that_asks_for_the_prompt_learns_from_its_distinct_tokens_first():
    calls = []

    class Recording(PromptLookupDrafter):
        needs = Needs(top_k=2, prefill=True)

        def learn(self, outcome):
            calls.append(outcome)
            return []

    model = tiny_model("llama", vocab=16)
    prompt = [1, 2, 3, 1, 2, 9]
    events = list(decode(model, prompt, Recording(), 4))
    first = calls[0]
    assert first.is_prompt and first.forward_ms is None
    assert first.tokens.tolist() == [3, 1, 2]  # the prompt but its last token: each distinct one at its last place
    assert first.top.shape == (3, 2) and len(calls) == 1 + len(events)


def test_the_draft_says_what_its_budget_chose_and_the_event_keeps_it():
    class Budgeted(PromptLookupDrafter):
        def __init__(self):
            super().__init__()
            self.n = 0

        def propose(self, context):
            self.n += 1
            proposed = super().propose(context)
            return Draft(proposed.tokens, proposed.tree, 7, {"sizes": [self.n]})

    model = tiny_model("llama", vocab=16)
    events = list(decode(model, [1, 2, 3, 4, 5, 6, 7] * 3, Budgeted(), 24))
    assert all(e.budget == 7 and e.budget_estimates == {"sizes": [e.step + 1]} for e in events)
    # drafters without a budget report none
    for e in decode(model, [1, 2, 3] * 3, PromptLookupDrafter(), 8):
        assert e.budget is None and e.budget_estimates == {}


def outcome(tokens, path, k, forward_ms, whole=True):
    return Outcome(tokens, torch.tensor(path), torch.zeros(tokens.numel(), k, dtype=torch.long), None, forward_ms,
                   whole)


def test_the_adaptive_drafter_drafts_the_size_its_budget_chose_and_teaches_it():
    order = [(0,), (1,), (0, 0), (2,)]
    nested = nested_trees(order, [1, 3, 5])
    budget = TreeBudget([1, 3, 5], [10.0, 10.0, 10.0], [1.0, 0.5, 0.5, 0.4, 0.4], explore_every=2,
                        acceptance_rate=0.5)
    drafter = AdaptiveRecyclingDrafter(AdjacencyMatrix(VOCAB, 3), nested, budget)
    proposed = drafter.propose(torch.tensor([4, 5]))
    assert proposed.tree is drafter.nested.trees[2] and proposed.tokens.numel() == 5 and proposed.budget == 4
    # the accepted path root -> (0,) -> (0, 0): in BFS order nodes 0, 1, 3; likeliest first positions 1 and 3
    assert proposed.tree.node_paths == ((), (0,), (1,), (2,), (0, 0))
    drafter.learn(outcome(proposed.tokens, [0, 1, 4], 3, 20.0))
    assert budget.acceptance == [1.0, 0.75, 0.25, 0.7, 0.2]
    assert budget.speed > 1  # the step took twice the calibrated time
    proposed = drafter.propose(torch.tensor([4, 5]))  # step 2 explores the size below
    assert proposed.tree is drafter.nested.trees[1] and proposed.estimates["explored"]
    # near the context's end the loop verifies the root alone: nothing is learned from that step
    before = (budget.speed, list(budget.correction), list(budget.acceptance))
    drafter.learn(outcome(proposed.tokens[:1], [0], 3, 99.0, whole=False))
    assert (budget.speed, budget.correction, budget.acceptance) == before


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


def test_the_probabilities_of_the_top_k_are_the_softmax_and_computed_only_when_read():
    calls = []

    class Recording(PromptLookupDrafter):
        needs = Needs(top_k=3)

        def learn(self, outcome):
            calls.append(outcome)
            return []

    model = tiny_model("llama", vocab=16)
    list(decode(model, [1, 2, 3, 4, 5, 6, 7] * 3, Recording(), 12))
    assert calls and all("probs" not in o.__dict__ for o in calls)  # nobody read them: no softmax was taken
    for o in calls:
        want = torch.softmax(o.logits.float(), dim=-1).gather(1, o.top)
        torch.testing.assert_close(o.probs, want)
        assert o.probs.dtype == torch.float32 and bool((o.probs.sum(dim=1) <= 1 + 1e-5).all())
