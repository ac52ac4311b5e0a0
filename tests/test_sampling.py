"""Sampling (tr_core/sampling.py): every method's sampled output equals plain sampling's, token for token, and plain
sampling draws from the model's exact distribution; a wrong acceptance rule fails the same statistical test."""

import json
import math

import pytest
import torch
from conftest import VOCAB, tiny_model
from test_real_model import NEAR_TIE

from tr_core import AdjacencyMatrix, PlainDrafter, PromptLookupDrafter, RecyclingDrafter, decoding, load_template, run
from tr_core.beyond.context import ContextRecyclingDrafter, PlusRecyclingDrafter
from tr_core.beyond.dynamic import DynamicRecyclingDrafter
from tr_core.beyond.suffix import SuffixDrafter
from tr_core.budget import TreeBudget, candidate_sizes
from tr_core.drafters import AdaptiveRecyclingDrafter, nested_trees
from tr_core.events import StepEvent
from tr_core.rivals.lookahead import LookaheadDrafter
from tr_core.sampling import Sampler, Sampling, gumbel

METHODS = ("plain", "pld", "suffix", "lookahead", "tr", "tr-adaptive", "tr-context", "tr-dynamic", "tr-plus")
TIMING = ("forward_ms", "overhead_ms", "elapsed_s")


def drafter_for(method: str, matrix: AdjacencyMatrix):
    """One drafter of each method, built as the engine builds it (trees of the "small" template's nodes, BFS order
    standing for likeliest first, sized by a budget on a made-up step-time curve); ``matrix`` carries over."""
    order = list(load_template("small").node_paths[1:])
    sizes = candidate_sizes(len(order) + 1)
    budget = TreeBudget(sizes, [10.0 + 0.5 * n for n in sizes], [1.0] + [0.6 ** len(p) for p in order],
                        explore_every=3)
    nested = nested_trees(order, sizes)
    return {"plain": PlainDrafter, "pld": PromptLookupDrafter, "suffix": SuffixDrafter,
            "lookahead": lambda: LookaheadDrafter(4, 4, 4),
            "tr": lambda: RecyclingDrafter(matrix, load_template("paper"), True),
            "tr-adaptive": lambda: AdaptiveRecyclingDrafter(matrix, nested, budget, True),
            "tr-context": lambda: ContextRecyclingDrafter(matrix, nested, budget, True),
            "tr-dynamic": lambda: DynamicRecyclingDrafter(matrix.with_probs(), budget=budget, seed_from_prompt=True),
            "tr-plus": lambda: PlusRecyclingDrafter(matrix.with_probs(), nested, budget, True)}[method]()


@torch.inference_mode()
def reference_sampling(model, prompt: list[int], new: int, sampling: Sampling) -> list[int]:
    """Plain sampling without the engine: a from-scratch forward over the whole sequence for every token, the
    token at position p = argmax(processed logits + gumbel(seed, p))."""
    seq = list(prompt)
    for _ in range(new):
        logits = model(input_ids=torch.tensor([seq])).logits[0, -1:]
        seq.append(int((sampling.processed(logits)[0] + gumbel(sampling.seed, len(seq), logits.shape[-1])).argmax()))
    return seq[len(prompt):]


# --- the configuration ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.1}, "temperature must be"), ({"temperature": math.inf}, "temperature must be"),
    ({"temperature": 1, "top_p": 0}, "top_p must be in"), ({"temperature": 1, "top_p": 1.5}, "top_p must be in"),
    ({"temperature": 1, "sample_top_k": -1}, "sample_top_k must be"), ({"sample_top_k": 2.5}, "sample_top_k must"),
    ({"seed": -1}, "seed must be"), ({"seed": 1.5}, "seed must be")])
def test_bad_values_raise_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**kwargs)


def reference_processed(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The processed logits by the definition, one row at a time with a full sort: keep the top-k, then the
    fewest likeliest tokens whose probability reaches top_p (and every token tied with the last of them)."""
    out = []
    for z in logits.double() / s.temperature:
        if s.sample_top_k:
            z = torch.where(z >= z.sort(descending=True).values[s.sample_top_k - 1], z, -math.inf)
        values = z.sort(descending=True).values
        mass = torch.softmax(values, 0).cumsum(0)
        last = values[min(int((mass < s.top_p).sum()), len(values) - 1)]
        out.append(torch.where(z >= last, z, -math.inf))
    return torch.stack(out)


def test_the_filters_keep_what_the_definition_keeps():
    # hand-worked: probabilities 0.5, 0.3, 0.15, 0.05
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))

    def kept(**kw):
        return Sampling(1.0, **kw).processed(logits).isfinite()[0].tolist()

    assert kept() == [True] * 4
    assert kept(top_p=0.5) == [True, False, False, False]  # 0.5 reaches 0.5
    assert kept(top_p=0.79) == [True, True, False, False]
    assert kept(top_p=0.81) == [True, True, True, False]
    assert kept(sample_top_k=2, top_p=0.9) == [True, True, False, False]  # top-p of the renormalised pair
    assert kept(sample_top_k=3) == [True, True, True, False]
    # against the definition on random rows, some wide (past the first windows of the top-p search)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5000, generator=g, dtype=torch.float64) * torch.tensor([[0.1], [1], [3], [0.01], [2], [5]],
                                                                                   dtype=torch.float64)
    for s in (Sampling(0.7, top_p=0.9), Sampling(1.3, top_p=0.5, sample_top_k=300), Sampling(1.0, sample_top_k=7),
              Sampling(2.0, top_p=0.999)):
        assert torch.equal(s.processed(logits).isfinite(), reference_processed(logits, s).isfinite()), s


def test_no_filter_changes_nothing_and_temperature_zero_is_greedy():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for s in (Sampling(0.7), Sampling(0.7, top_p=1.0, sample_top_k=0), Sampling(0.7, sample_top_k=VOCAB)):
        assert torch.equal(s.processed(logits), logits / 0.7)
    assert torch.equal(Sampling(0.0, top_p=0.3, seed=5).choose(logits, torch.tensor([4, 5, 6])), logits.argmax(-1))


def test_the_noise_depends_on_seed_and_position_only():
    noise = gumbel(7, 40, VOCAB)
    assert noise.dtype == torch.float64 and torch.isfinite(noise).all()
    assert torch.equal(noise, gumbel(7, 40, VOCAB)) and not torch.equal(noise, gumbel(8, 40, VOCAB))
    sampler = Sampler(Sampling(0.9, seed=7))
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    together = sampler.choose(logits, torch.tensor([40, 41, 41, 42]))
    alone = [int(Sampling(0.9, seed=7).choose(logits[i:i + 1], torch.tensor([p])))
             for i, p in enumerate([40, 41, 41, 42])]
    assert together.tolist() == alone  # a row's choice is the same in any batch


# --- every method equals plain sampling ----------------------------------------------------------------------------

SAMPLINGS = [Sampling(0.7, seed=1), Sampling(1.0, top_p=0.9, seed=2), Sampling(1.3, sample_top_k=20, seed=3),
             Sampling(0.9, top_p=0.8, sample_top_k=50, seed=4)]


def test_every_method_equals_plain_sampling_on_tiny_models(tiny):
    arch, model = tiny
    g = torch.Generator().manual_seed(len(arch))
    prompts = [torch.randint(0, VOCAB, (12,), generator=g).tolist() * 2 for _ in range(2)]  # repeats: pld drafts
    matrices = {m: AdjacencyMatrix(VOCAB, 8) for m in METHODS}  # hot: carried over prompts and samplings
    drafted = {m: 0 for m in METHODS}
    for sampling in SAMPLINGS:
        for prompt in prompts:
            want = reference_sampling(model, prompt, 40, sampling)
            for method in METHODS:
                result = run(model, prompt, drafter_for(method, matrices[method]), 40, sampling=sampling)
                assert result.token_ids == want, f"{arch} {method} {sampling.describe()}"
                drafted[method] += sum(len(e.accepted_path) - 1 for e in result.events)
                e = result.events[-1]
                assert e.sampling == sampling.describe() and len(e.draft_probs) == len(e.tree_tokens)
    assert all(drafted[m] > 0 for m in METHODS if m != "plain"), drafted  # drafts were accepted by every method
    print(arch, "accepted draft tokens:", drafted)


def test_temperature_zero_is_greedy_bit_for_bit(tiny):
    arch, model = tiny
    prompt = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(3)).tolist() * 2
    for method in ("plain", "pld", "suffix", "tr"):  # the drafters whose trees do not follow measured step times
        events = [[{k: v for k, v in e.to_dict().items() if k not in TIMING} for e in
                   run(model, prompt, drafter_for(method, AdjacencyMatrix(VOCAB, 8)), 32, sampling=s).events]
                  for s in (None, Sampling(0.0, top_p=0.5, sample_top_k=3, seed=9))]
        assert events[0] == events[1] and events[0][0]["sampling"] == "greedy" and events[0][0]["draft_probs"] == []


def test_sampled_events_are_plain_data_that_round_trip_and_give_each_drafts_probability():
    model = tiny_model("llama")
    sampling = Sampling(0.8, top_p=0.95, seed=11)
    events = run(model, list(range(20)) * 2, drafter_for("tr", AdjacencyMatrix(VOCAB, 8)), 24,
                 sampling=sampling).events
    for e in events:
        assert StepEvent.from_dict(json.loads(json.dumps(e.to_dict()))) == e
        assert e.draft_probs[0] == 1.0 and all(0.0 <= p <= 1.0 for p in e.draft_probs)
        # every accepted node is the choice at its parent, and the choices had a probability above 0
        path = e.accepted_path
        assert all(e.tree_tokens[c] == e.predicted[p] and e.draft_probs[c] > 0 for p, c in zip(path, path[1:]))
    # the probabilities of one parent's children sum to at most 1
    e = max(events, key=lambda e: len(e.tree_tokens))
    for parent in set(e.tree_parents[1:]):
        assert sum(p for p, q in zip(e.draft_probs, e.tree_parents) if q == parent) <= 1 + 1e-9


# --- the distribution: a statistical test on a tiny float64 model ----------------------------------------------------

DIST_VOCAB, DIST_SEEDS, ALPHA = 8, 3000, 0.01
DIST_PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # pld finds a match at once
DIST_SAMPLING = dict(temperature=4.0, top_p=0.9, sample_top_k=3)  # 27 outcomes of 0.03-0.08: power for 2% shifts


@torch.inference_mode()
def exact_joint(model, sampling: Sampling) -> dict[tuple[int, int, int], float]:
    """The exact probability of every first three tokens under ``sampling``, from the model's probabilities."""
    def probs(prefix):
        logits = model(input_ids=torch.tensor([DIST_PROMPT + list(prefix)])).logits[0, -1:]
        return torch.softmax(sampling.processed(logits), dim=-1)[0].tolist()

    out = {}
    for a, pa in enumerate(probs(())):
        for b, pb in enumerate(probs((a,)) if pa else []):
            for c, pc in enumerate(probs((a, b)) if pb else []):
                if pc:
                    out[a, b, c] = pa * pb * pc
    return out


def max_deviation_p_value(counts: dict, exact: dict, n: int) -> float:
    """The p-value of the largest standardised deviation of an outcome's frequency from its exact probability
    (two-sided normal tails, Bonferroni over the outcomes): small where any outcome's share is off."""
    p = torch.tensor([exact[k] for k in exact], dtype=torch.float64)
    freq = torch.tensor([counts.get(k, 0) for k in exact], dtype=torch.float64) / n
    z = float(((freq - p).abs() / (p * (1 - p) / n).sqrt()).max())
    outside = sum(c for k, c in counts.items() if k not in exact)  # an outcome of probability 0 fails at once
    return 0.0 if outside else min(1.0, len(exact) * math.erfc(z / math.sqrt(2)))


def first_three(model, method: str, seeds: range) -> dict[int, tuple[int, ...]]:
    """The first three tokens ``method`` samples, per seed (tr: the "small" tree from a matrix seeded from the
    prompt, so that its drafts are the model's likeliest tokens)."""
    out = {}
    for seed in seeds:
        drafter = {"plain": PlainDrafter, "pld": PromptLookupDrafter, "tr": lambda: RecyclingDrafter(
            AdjacencyMatrix(DIST_VOCAB, 4), load_template("small"), seed_from_prompt=True)}[method]()
        out[seed] = tuple(run(model, DIST_PROMPT, drafter, 3, sampling=Sampling(**DIST_SAMPLING, seed=seed)).token_ids)
    return out


def counted(outputs: dict) -> dict:
    counts: dict = {}
    for tokens in outputs.values():
        counts[tokens] = counts.get(tokens, 0) + 1
    return counts


@torch.inference_mode()
def plain_first_three(model, seeds: range) -> dict[int, tuple[int, int, int]]:
    """Plain sampling's first three tokens per seed, as ``reference_sampling`` chooses them, with each prefix's
    processed logits computed once."""
    processed: dict = {}
    out = {}
    for seed in seeds:
        seq = list(DIST_PROMPT)
        for _ in range(3):
            key = tuple(seq)
            if key not in processed:
                logits = model(input_ids=torch.tensor([seq])).logits[0, -1:]
                processed[key] = Sampling(**DIST_SAMPLING).processed(logits)[0]
            seq.append(int((processed[key] + gumbel(seed, len(seq), DIST_VOCAB)).argmax()))
        out[seed] = tuple(seq[len(DIST_PROMPT):])
    return out


@pytest.fixture(scope="module")
def dist_model():
    model = tiny_model("llama", vocab=DIST_VOCAB)
    return model, exact_joint(model, Sampling(**DIST_SAMPLING))


def test_the_statistical_test_has_power_to_detect_a_two_percent_shift(dist_model):
    _, exact = dist_model
    ranked = sorted(exact, key=exact.get, reverse=True)
    g = torch.Generator().manual_seed(0)
    for a, b in ((0, 1), (1, 2), (0, -1)):  # 0.02 moved between the likeliest outcomes, or to the least likely
        shifted = dict(exact)
        shifted[ranked[a]] -= 0.02
        shifted[ranked[b]] += 0.02
        keys = list(shifted)
        rejected = 0
        for _ in range(100):
            draws = torch.multinomial(torch.tensor([shifted[k] for k in keys]), DIST_SEEDS, True, generator=g)
            counts = dict(zip(keys, torch.bincount(draws, minlength=len(keys)).tolist()))
            rejected += max_deviation_p_value(counts, exact, DIST_SEEDS) < ALPHA
        assert rejected >= 80, f"a 2% shift between outcomes {a} and {b} was detected {rejected}/100 times"


@pytest.mark.slow
def test_tr_and_pld_sample_the_exact_joint_distribution_of_three_tokens(dist_model):
    model, exact = dist_model
    seeds = range(DIST_SEEDS)
    plain = plain_first_three(model, seeds)
    assert first_three(model, "plain", seeds[:200]) == {s: plain[s] for s in seeds[:200]}  # the engine's plain
    assert max_deviation_p_value(counted(plain), exact, DIST_SEEDS) > ALPHA  # plain sampling follows the model
    for method in ("pld", "tr"):
        outputs = first_three(model, method, seeds)
        assert max_deviation_p_value(counted(outputs), exact, DIST_SEEDS) > ALPHA, method
        assert outputs == plain  # and, seed by seed, the same tokens as plain sampling


@pytest.mark.slow
def test_a_wrong_acceptance_rule_fails_the_same_test(dist_model, monkeypatch):
    """The deliberately wrong rule: accept a draft child whenever its token is inside its parent's kept set (top-k
    and top-p), instead of only when it is the parent's sampled choice."""
    model, exact = dist_model
    right = decoding.choose

    def accept_inside_the_set(logits, k, sampler, positions, tokens, tree, whole=None):
        chosen, top, probs = right(logits, k, sampler, positions, tokens, tree, whole)
        kept = sampler.sampling.processed(logits).isfinite()
        chosen, taken = chosen.clone(), set()
        for i, parent in enumerate(tree.parents.tolist()[1:], start=1):
            if parent not in taken and kept[parent, tokens[i]]:
                chosen[parent] = tokens[i]
                taken.add(parent)
        return chosen, top, probs

    monkeypatch.setattr(decoding, "choose", accept_inside_the_set)
    counts = counted(first_three(model, "tr", range(DIST_SEEDS)))
    p_value = max_deviation_p_value(counts, exact, DIST_SEEDS)
    print(f"\nthe wrong rule: p = {p_value:.1e}")
    assert p_value < ALPHA


# --- the embedded model ----------------------------------------------------------------------------------------------

EMBEDDED_TOKENS = 8  # each of 2 prompts by plain sampling and every method


@pytest.mark.slow
def test_every_method_equals_plain_sampling_on_the_embedded_model(embedded):
    from tr_core import encode_prompt, eos_token_ids

    model, tokenizer = embedded
    eos, vocab = eos_token_ids(model, tokenizer), model.get_output_embeddings().weight.shape[0]
    matrices = {m: AdjacencyMatrix(vocab, 8) for m in METHODS}
    identical = total = 0
    for seed, prompt in enumerate(["Write a short story about a lighthouse keeper.",
                                   "Explain why the sky is blue, in three sentences."]):
        sampling, ids = Sampling(0.7, seed=seed), encode_prompt(tokenizer, prompt)
        plain = run(model, ids, PlainDrafter(), EMBEDDED_TOKENS, eos, sampling=sampling).token_ids
        for method in [m for m in METHODS if m not in ("plain", "tr-adaptive")]:
            out = run(model, ids, drafter_for(method, matrices[method]), EMBEDDED_TOKENS, eos,
                      sampling=sampling).token_ids
            identical, total = identical + (out == plain), total + 1
            # checked independently: each token is the argmax of a from-scratch forward's perturbed logits, up to
            # fp32 near-ties
            with torch.inference_mode():
                logits = model(input_ids=torch.tensor([ids + out])).logits[0, len(ids) - 1:-1]
            perturbed = sampling.processed(logits) + torch.stack(
                [gumbel(seed, len(ids) + i, vocab) for i in range(len(out))]).float()
            gap = perturbed.max(dim=1).values - perturbed.gather(1, torch.tensor(out)[:, None])[:, 0]
            assert float(gap.max()) < NEAR_TIE / sampling.temperature, f"{method}: a token {float(gap.max()):.2e} below"
    print(f"\nembedded model, T=0.7, {EMBEDDED_TOKENS} tokens: identical to plain sampling {identical}/{total}")
    assert identical >= total - 1


# --- the command line and the benchmark ------------------------------------------------------------------------------

def test_the_command_line_samples_and_every_method_gives_plain_samplings_answer(tiny_folder, tmp_path, capsys):
    from tr_core.__main__ import main

    folder, _, _ = tiny_folder
    base = ["--prompt", "Name three colours.", "--model", str(folder), "--max-new-tokens", "16", "--tree", "small",
            "--top-k", "4", "--json", "--temperature", "0.8", "--top-p", "0.95", "--sample-top-k", "40", "--seed", "5"]
    outputs = {}
    for method in ("plain", "pld", "tr"):
        trace = tmp_path / f"{method}.json"
        assert main(base + ["--method", method, "--trace", str(trace)]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["sampling"] == "sampled: T=0.8, top-p 0.95, top-k 40, seed 5"
        events = [StepEvent.from_dict(d) for d in json.loads(trace.read_text())["events"]]
        assert all(e.sampling == out["sampling"] for e in events)
        outputs[method] = out["token_ids"]
    assert outputs["plain"] == outputs["pld"] == outputs["tr"]
    assert main(base[:-8] + ["--temperature", "-1"]) == 2
    assert "temperature must be" in capsys.readouterr().err


def test_the_benchmark_reports_each_temperature(tiny_folder, tmp_path, capsys):
    from tr_core.tools.bench import main

    folder, _, _ = tiny_folder
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": "qa", "turns": [f"Question {i}: repeat."]})
                                   for i in range(2)))
    out = tmp_path / "out"
    assert main(["--model", str(folder), "--questions", str(questions), "--per-category", "2", "--max-new-tokens", "8",
                 "--rounds", "1", "--methods", "pld,tr", "--temperatures", "0,0.7", "--seed", "2",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert list(results["temperatures"]) == ["0", "0.7"] and results["config"]["sampling"] == "greedy"
    assert results["temperatures"]["0.7"]["sampling"] == "sampled: T=0.7, seed 2"
    for entry in results["temperatures"].values():
        assert set(entry["methods"]) == {"plain", "pld", "tr"}
        for m in entry["methods"].values():
            assert m["identical"] == m["questions"] == 2 and m["mean_accepted_tokens"] >= 1
            assert {"speedup_median", "speedup_ci95", "verdict"} <= set(m)
    assert "## per temperature" in printed and "| 0.7 | tr |" in printed
    with pytest.raises(SystemExit):
        main(["--temperatures", "0,-1"])
