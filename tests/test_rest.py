"""REST (``tr_core.rivals.rest``): the suffix array and its search on hand-worked and random corpora, the draft's
trie, plain decoding's exact tokens (greedy and seeded sampling, float64 tiny models), and the datastore built once
and shared."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import VOCAB, reference_greedy
from test_sampling import SAMPLINGS, reference_sampling

from tr_core import run
from tr_core.rivals.rest import SEP, SORTED, Datastore, RestDrafter, build_datastore, suffix_array


def brute_order(tokens: list[int], length: int) -> list[int]:
    """The suffix array by sorting the suffixes' first ``length`` tokens (stable: ties in start order)."""
    return sorted(range(len(tokens)), key=lambda i: tokens[i:i + length])


@pytest.mark.parametrize("seed", range(6))
def test_the_suffix_array_orders_suffixes_by_their_first_tokens(seed):
    g = np.random.default_rng(seed)
    tokens = g.integers(0, 3 + seed, size=int(g.integers(1, 300))).tolist()  # few symbols: long repeats
    if seed % 2:
        tokens = [SEP if t == 0 else t for t in tokens]
    for length in (1, 2, 5, 16):
        order = suffix_array(np.array(tokens), length).tolist()
        assert [tokens[i:i + length] for i in order] == [tokens[i:i + length] for i in brute_order(tokens, length)]
    assert suffix_array(np.array([], dtype=np.int32)).size == 0


def brute_match(tokens: list[int], context: list[int]) -> tuple[int, list[int]]:
    """The longest suffix of ``context`` (at most SORTED tokens) found in ``tokens`` with a token (not SEP) after it,
    and the positions after its occurrences."""
    for m in range(min(SORTED, len(context)), 0, -1):
        pattern = context[-m:]
        starts = [i for i in range(len(tokens) - m + 1) if tokens[i:i + m] == pattern]
        if starts:
            return m, [i + m for i in starts if i + m < len(tokens) and tokens[i + m] != SEP]
    return 0, []


@pytest.mark.parametrize("seed", range(8))
def test_the_search_finds_the_longest_match_and_every_occurrence(seed):
    g = np.random.default_rng(100 + seed)
    tokens = g.integers(0, 4, size=400).tolist()
    tokens = [SEP if t == 0 and i % 7 == 0 else t for i, t in enumerate(tokens)]
    store = Datastore(np.array(tokens, dtype=np.int32))
    for _ in range(20):
        start = int(g.integers(0, 390))
        context = [9] + tokens[start:start + int(g.integers(1, 30))]  # 9 never occurs: the match is bounded
        context = [t for t in context if t != SEP] or [1]
        assert store.longest_match(context) == brute_match(tokens, context), context
    assert store.longest_match([9]) == (0, [])


def test_hand_worked_continuations_stop_at_a_documents_end_and_count_occurrences():
    # three documents; the context ends in 4 5
    store = Datastore(np.array([4, 5, 6, 7, SEP, 1, 4, 5, 6, 8, SEP, 4, 5, SEP, 2, 4, 5, 9], dtype=np.int32))
    m, after = store.longest_match([3, 4, 5])
    assert (m, after) == (2, [2, 8, 17])  # the occurrence at the end of the third document has nothing after it
    trie = store.continuations([3, 4, 5], depth=3)
    assert trie.tokens == [5, 6, 7, 8, 9] and trie.parents == [-1, 0, 1, 1, 0] and trie.counts == [3, 2, 1, 1, 1]
    assert trie.best_first(2) == [1, 2]  # 6 (2 of 3), then 7 (the first of the equals)
    limited = store.longest_match([3, 4, 5], limit=2)
    assert limited[0] == 2 and len(limited[1]) <= 2 and set(limited[1]) <= {2, 8, 17}
    draft = RestDrafter(store, max_nodes=3, depth=3).propose(torch.tensor([3, 4, 5]))
    assert draft.tokens.tolist() == [5, 6, 7, 8] and draft.tree.parents.tolist() == [-1, 0, 1, 1]  # 6, then 7, 8
    assert draft.tree.sources == ("root", "datastore", "datastore", "datastore")
    assert RestDrafter(store).propose(torch.tensor([3, 3])).tokens.tolist() == [3]  # no match: the root alone


def test_a_datastore_round_trips_through_its_file(tmp_path):
    class Tokens:  # a tokenizer of digits: "123" -> [1, 2, 3]
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [int(c) for c in text if c.isdigit()]}

    store = build_datastore(Tokens(), [("a", "1234"), ("b", "2345")], {"source": "digits"})
    assert store.tokens.tolist() == [1, 2, 3, 4, SEP, 2, 3, 4, 5, SEP]
    assert store.about["documents"] == 2 and store.about["tokens"] == 10 and store.about["source"] == "digits"
    store.save(tmp_path / "d.npz")
    again = Datastore.load(tmp_path / "d.npz")
    assert again.tokens.tolist() == store.tokens.tolist() and again.order.tolist() == store.order.tolist()
    assert again.about == store.about and again.longest_match([9, 2, 3]) == (2, [3, 7])


def oracle_store(continuation: list[int], seed: int) -> Datastore:
    """A datastore holding the reference continuation in pieces, among random documents: drafts along the real
    answer are found, and wrong ones too."""
    g = np.random.default_rng(seed)
    docs = [g.integers(0, VOCAB, size=50).tolist() for _ in range(10)]
    for i in range(0, len(continuation), 12):
        docs.append(continuation[max(0, i - 4):i + 12])
        noisy = list(continuation[max(0, i - 4):i + 12])
        if noisy:
            noisy[len(noisy) // 2] = int(g.integers(0, VOCAB))
            docs.append(noisy)
    tokens = [t for d in docs for t in d + [SEP]]
    return Datastore(np.array(tokens, dtype=np.int32))


@pytest.mark.slow
def test_rest_gives_plain_greedy_decodings_tokens(tiny):
    arch, model = tiny
    g = torch.Generator().manual_seed(7)
    accepted = 0
    for i in range(6):
        prompt = torch.randint(0, VOCAB, (int(torch.randint(4, 30, (1,), generator=g)),), generator=g).tolist()
        want = reference_greedy(model, prompt, 48)
        random_store = Datastore(np.random.default_rng(i).integers(0, VOCAB, size=3000).astype(np.int32))
        for store in (oracle_store(want, i), random_store):
            result = run(model, prompt, RestDrafter(store), 48)
            assert result.token_ids == want, f"{arch}: REST differs from plain greedy decoding"
            accepted += sum(len(e.accepted_path) - 1 for e in result.events)
            assert all(s in ("root", "datastore") for e in result.events for s in e.tree_sources)
    assert accepted > 0, "no draft of the oracle datastore was ever accepted"


def test_rest_gives_plain_samplings_tokens(tiny):
    arch, model = tiny
    g = torch.Generator().manual_seed(11)
    accepted = 0
    for sampling in SAMPLINGS[:2]:
        prompt = torch.randint(0, VOCAB, (10,), generator=g).tolist()
        want = reference_sampling(model, prompt, 32, sampling)
        result = run(model, prompt, RestDrafter(oracle_store(want, 3)), 32, sampling=sampling)
        assert result.token_ids == want, f"{arch} REST {sampling.describe()}"
        accepted += sum(len(e.accepted_path) - 1 for e in result.events)
    assert accepted > 0


def test_the_engine_drafts_rest_sized_by_this_machines_step_times(tiny_folder):
    """``Engine(...).generate(method="rest")``: plain decoding's tokens, drafts from the datastore it is given, at
    most 8 nodes a step and sized by t(N) measured for the model (a datastore holding the answer drafts it)."""
    from tr_core.engine import Engine

    _, model, tokenizer = tiny_folder
    engine = Engine(model, tokenizer)
    plain = engine.generate("Hello there", 24, method="plain")
    prompt_ids = engine.encode("Hello there")
    engine.use_datastore(Datastore(np.array(prompt_ids + plain.token_ids + [SEP] + prompt_ids[-3:] + plain.token_ids,
                                            dtype=np.int32)))
    drafter = engine.drafter("rest")
    assert drafter.step_ms is not None and drafter.step_ms(8) >= drafter.step_ms(1) > 0
    rest = engine.generate("Hello there", 24, method="rest")
    assert rest.token_ids == plain.token_ids
    assert all(len(e.tree_tokens) <= 9 and set(e.tree_sources) <= {"root", "datastore"} for e in rest.events)
    assert sum(len(e.accepted_path) - 1 for e in rest.events) > 0


def test_rests_estimates_are_scaled_by_how_often_they_came_true_and_the_engine_keeps_the_scale(tiny_folder):
    from tr_core.beyond.dynamic import PathCalibration
    from tr_core.drafters import Outcome
    from tr_core.engine import Engine

    store = Datastore(np.array([1, 2, 3, 4, 1, SEP, 1, 2, 3, 5, SEP, 2, 3, 4, 2], dtype=np.int32))
    calibration = PathCalibration()
    drafter = RestDrafter(store, step_ms=lambda n: 10.0 + n, calibration=calibration)
    draft = drafter.propose(torch.tensor([9, 2, 3]))  # after 2 3: 4 twice, 5 once; 4 pays for itself at factor 1
    assert draft.tokens.tolist()[:2] == [3, 4]
    drafter.learn(Outcome(draft.tokens, torch.tensor([0]), None, None))  # nothing accepted
    assert calibration.factor < 1
    for _ in range(60):
        calibration.observe(predicted=2.0, accepted=0)
    assert drafter.propose(torch.tensor([9, 2, 3])).tokens.tolist() == [3]  # no longer worth a node
    _, model, tokenizer = tiny_folder
    engine = Engine(model, tokenizer)
    engine.use_datastore(store)
    assert engine.drafter("rest").calibration is engine.drafter("rest").calibration
