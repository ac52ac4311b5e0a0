"""Lookahead decoding (``tr_core.rivals.lookahead``): the n-gram pool, the Jacobi window and its update, the draft
tree's mask (the paper's lookahead mask, as a tree), and plain decoding's exact tokens, greedy and sampled."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, reference_greedy
from test_sampling import SAMPLINGS, reference_sampling

from tr_core import run
from tr_core.drafters import Outcome
from tr_core.rivals.lookahead import LADDER, JacobiWindow, LookaheadDrafter, NgramPool, choose_size


def test_the_pool_keeps_the_latest_continuations_of_each_token_and_reads_a_growing_context_once():
    pool = NgramPool(n=3, size=2)
    pool.add_text([1, 2, 3, 1, 2])
    assert pool.candidates(1) == [(2, 3)] and pool.candidates(2) == [(3, 1)] and pool.candidates(3) == [(1, 2)]
    pool.add_text([1, 2, 3, 1, 2, 4, 1, 2, 5])  # the context grew: only its new n-grams are read
    assert pool.candidates(1) == [(2, 5), (2, 4)]  # (2, 3) is the least recent of three: dropped
    assert pool.candidates(2) == [(4, 1), (3, 1)]
    whole = NgramPool(n=3, size=2)
    whole.add_text([1, 2, 3, 1, 2, 4, 1, 2, 5])
    assert whole.table == pool.table
    pool.add(1, (2, 4))  # seen again: the latest again
    assert pool.candidates(1) == [(2, 4), (2, 5)]
    pool.add(1, (9,))  # not an n-gram of this pool's n: ignored
    assert pool.candidates(1) == [(2, 4), (2, 5)]


def test_the_window_moves_each_guess_to_its_own_position_after_a_step():
    """W = 3, N = 4: level 0 guesses positions 1-2, level 1 positions 1-3, level 2 positions 2-4 (after the root)."""
    window = JacobiWindow(3, 4, [[11, 12], [21, 22, 23], [32, 33, 34]], fill=[90, 91, 92])
    assert window.ngrams(5, [41, 42, 43]) == [(5, (21, 32, 41)), (11, (22, 33, 42)), (12, (23, 34, 43))]
    window.advance([43, 44, 45], moved=1)  # the outputs guess positions 3-5; the root moved to position 1
    assert window.levels == [[22, 23], [32, 33, 34], [43, 44, 45]]
    window = JacobiWindow(3, 4, [[11, 12], [21, 22, 23], [32, 33, 34]], fill=[90, 91, 92])
    window.advance([43, 44, 45], moved=2)  # the root moved to position 2: what guessed positions 1-2 is gone
    assert window.levels == [[23, 90], [33, 34, 91], [44, 45, 92]]
    assert JacobiWindow.filled(2, 3, [7]).levels == [[7], [7, 7]]


def test_the_draft_is_the_lookahead_mask_as_a_tree_each_token_at_its_own_position():
    """With distinct guesses (nothing merges): a level-l guess at position p sees the oldest level's guesses before
    p - l + 1, one guess of every level in between (its diagonal) and itself, one token per position; an n-gram is
    a chain from the root."""
    width, n = 4, 4
    levels = [[100 + p for p in range(1, width)]] + [[100 * (lv + 1) + lv + j for j in range(width)]
                                                    for lv in range(1, n - 1)]
    drafter = LookaheadDrafter(width, n, guesses=1, window=JacobiWindow(width, n, levels, fill=[1]))
    drafter.pool.add(7, (60, 61, 62))
    draft = drafter.propose(torch.tensor([3, 7]))
    tokens, tree = draft.tokens.tolist(), draft.tree
    assert len(tokens) == 1 + 3 + (width - 1) + width * (n - 2)
    where = {t: i for i, t in enumerate(tokens)}

    def seen(token):  # the tokens a node attends to, by position
        row = tree.mask[where[token]]
        return sorted((int(tree.depth[j]), tokens[j]) for j in range(len(tokens)) if row[j])

    assert seen(62) == [(0, 7), (1, 60), (2, 61), (3, 62)]
    assert seen(103) == [(0, 7), (1, 101), (2, 102), (3, 103)]  # the oldest level: a chain
    # level 2's guess at position 4 (column 2): the oldest level at 1-2, level 1 at 3, itself at 4
    assert seen(300 + 2 + 2) == [(0, 7), (1, 101), (2, 102), (3, 200 + 1 + 2), (4, 304)]
    for i in range(len(tokens)):  # one token per position 0 .. depth
        assert [d for d, _ in seen(tokens[i])] == list(range(int(tree.depth[i]) + 1))
    sources = dict(zip(tokens, tree.sources))
    assert sources[7] == "root" and sources[61] == "n-gram" and sources[304] == "window"


def test_learning_from_a_step_fills_the_pool_with_the_windows_trajectories_and_moves_the_window():
    width, n = 3, 3
    drafter = LookaheadDrafter(width, n, guesses=2, window=JacobiWindow(width, n, [[11, 12], [21, 22, 23]], [90]))
    draft = drafter.propose(torch.tensor([4, 5]))
    tokens = draft.tokens
    logits = torch.zeros(tokens.numel(), 200)
    newest = {21: 31, 22: 32, 23: 33}  # what the model outputs at the newest level's guesses
    for i, t in enumerate(tokens.tolist()):
        logits[i, newest.get(t, 0)] = 1.0
    path = torch.tensor([0, tokens.tolist().index(11)])  # the model agreed with the window's first guess
    drafter.learn(Outcome(tokens, path, None, logits))
    assert drafter.pool.candidates(5) == [(21, 31)] and drafter.pool.candidates(11) == [(22, 32)]
    assert drafter.pool.candidates(12) == [(23, 33)]
    assert drafter.window.levels == [[23, 90], [32, 33, 90]]  # moved by two tokens: 11 and the bonus


def test_the_size_is_chosen_by_this_machines_step_times():
    sizes = [dict(width=w, n=n, guesses=g, tokens_per_step=1.0 + 0.1 * i, nodes_per_step=float(w * n + g))
             for i, (w, n, g) in enumerate(LADDER)]
    flat = choose_size(sizes, lambda nodes: 10.0)
    steep = choose_size(sizes, lambda nodes: 10.0 + nodes)
    assert (flat["width"], flat["n"], flat["guesses"]) == LADDER[-1]
    assert (steep["width"], steep["n"], steep["guesses"]) == LADDER[0]
    assert "tokens per ms" in steep["why"]


def accepted(result) -> int:
    return sum(len(e.accepted_path) - 1 for e in result.events)


@pytest.mark.slow
def test_lookahead_gives_plain_greedy_decodings_tokens(tiny):
    arch, model = tiny
    g = torch.Generator().manual_seed(5)
    total = 0
    for i, (width, n, guesses) in enumerate([(2, 3, 1), (4, 4, 4), (5, 5, 3)]):
        prompt = torch.randint(0, VOCAB, (int(torch.randint(4, 30, (1,), generator=g)),), generator=g).tolist()
        prompt = prompt + prompt[: len(prompt) // 2]  # a repeat, so that the pool has n-grams to verify
        want = reference_greedy(model, prompt, 48)
        result = run(model, prompt, LookaheadDrafter(width, n, guesses), 48)
        assert result.token_ids == want, f"{arch}: lookahead W={width} N={n} G={guesses} differs from plain greedy"
        total += accepted(result)
        assert {s for e in result.events for s in e.tree_sources} <= {"root", "window", "n-gram"}
    assert total > 0, "no draft was ever accepted"


def test_lookahead_gives_plain_samplings_tokens(tiny):
    arch, model = tiny
    g = torch.Generator().manual_seed(13)
    for sampling in SAMPLINGS[:2]:
        prompt = torch.randint(0, VOCAB, (10,), generator=g).tolist()
        want = reference_sampling(model, prompt, 32, sampling)
        result = run(model, prompt, LookaheadDrafter(4, 4, 4), 32, sampling=sampling)
        assert result.token_ids == want, f"{arch} lookahead {sampling.describe()}"


def test_the_engine_drafts_lookahead_at_the_size_chosen_for_this_machine(tiny_folder):
    from tr_core.engine import Engine

    _, model, tokenizer = tiny_folder
    engine = Engine(model, tokenizer)
    size = engine.lookahead_size()
    assert {"width", "n", "guesses", "why"} <= set(size)
    drafter = engine.drafter("lookahead")
    assert (drafter.width, drafter.n, drafter.guesses) == (size["width"], size["n"], size["guesses"])
    plain = engine.generate("Hello there", 24, method="plain")
    result = engine.generate("Hello there", 24, method="lookahead")
    assert result.token_ids == plain.token_ids
    assert all(e.method == "lookahead" for e in result.events)
    assert any("window" in e.tree_sources for e in result.events)
