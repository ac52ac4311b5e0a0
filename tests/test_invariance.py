"""Batch invariance: a token's logits are the same bits whether it is computed alone (a plain step), inside a draft
tree of any size the engine runs, or inside a prefill chunk, for the kernels chosen on the machine that runs the
suite, in both modes and for each format the fast mode may pick here. What makes every method's output plain
decoding's token for token (tr_core/speed/attention.py, tr_core/speed/layouts.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from tr_core.decoding import decode, run
from tr_core.drafters import PlainDrafter, PromptLookupDrafter
from tr_core.speed import attention, chooser, invariance, kernels
from tr_core.speed.chooser import choose_plan, prepare_model
from tr_core.speed.invariance import CHUNKS, DEPTH, PASTS, TREE_SIZES, all_equal, differences, position_logits
from tr_core.speed.kernels import OutputHead
from tr_core.speed.layouts import (
    LAYOUTS,
    Layout,
    available_layouts,
    kernel_plan,
    make_plan,
    mode_formats,
    row_invariant,
)

pytestmark = pytest.mark.slow  # minutes: the embedded model in both modes, every candidate format

TEXT = ("The quick brown fox jumps over the lazy dog. " * 20) + "Once upon a time, in a land far away, there lived"


@pytest.fixture(scope="module")
def ids(embedded):
    ids = embedded[1](TEXT, return_tensors="pt")["input_ids"][0]
    assert ids.numel() >= max(PASTS) + DEPTH + 1
    return ids


def _prepared(embedded, mode: str):
    """A copy of the embedded model on ``mode``'s kernels chosen here, as the engine prepares it (``prepare_model``:
    the projections fused, the chooser's plan: what decoding runs, and measured once a machine)."""
    model = copy.deepcopy(embedded[0])
    plan = prepare_model(model, mode)
    return model, plan


def _fast_formats() -> list[str]:
    return [f for f in mode_formats("fast") if any(LAYOUTS[n].fmt == f for n in available_layouts())]


def test_attention_is_row_invariant_on_this_machine():
    # without it the lean forward keeps SDPA and no bit-equality below could hold: the suite says so plainly
    assert attention.batch_invariant(9, 3, 64), "no attention product is row-invariant here (attention.KINDS)"
    # and for the tiny test models' shapes (4 query heads, 2 or 4 key/value heads, head size 16)
    assert attention.batch_invariant(4, 2, 16) and attention.batch_invariant(4, 4, 16)


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_a_position_has_the_same_logits_alone_in_trees_and_in_prefills(embedded, ids, mode):
    model, plan = _prepared(embedded, mode)
    assert plan.invariant, kernels.describe_invariance(plan)
    assert "; batch-invariant" in kernels.describe_format(plan, kernels.attention_invariant(model))
    for past, by_way in position_logits(model, ids).items():
        found = differences(by_way)
        assert set(found) == {f"tree of {n}" for n in TREE_SIZES} | {f"prefill in {c}s" for c in CHUNKS}
        assert all_equal(found), (past, found)


@pytest.mark.parametrize("fmt", _fast_formats())
def test_each_format_the_fast_mode_may_pick_here_is_row_invariant_or_never_offered(embedded, ids, fmt):
    # the chooser's check (chooser.invariant_plans) and this test ask one function, invariance.check, of the plan the
    # chooser would run for the format (layouts.format_plans): a format whose whole model fails it here is one the
    # fast mode never runs here, and says so
    from tr_core.speed import layouts, lean

    model = copy.deepcopy(embedded[0])
    lean.fuse(model)
    gain = chooser.tree_gain(embedded[0])
    plans = layouts.format_plans(model, "fast", gain=gain)
    chosen = choose_plan(copy.deepcopy(model), "fast", gain=gain)
    if fmt not in plans:
        assert chosen.fmt != fmt
        pytest.skip(f"{fmt}: not as row-invariant here as the other formats' layouts: never a candidate")
    plan = plans[fmt]
    if plan.layouts == kernel_plan(model, "exact").layouts:
        pytest.skip(f"{fmt}: the exact mode's kernels, layer for layer (checked by the test above in exact mode)")
    prepare_model(model, "fast", plan)
    assert kernels.plan_of(model).fmt == fmt
    why = invariance.verdict(invariance.check(model))
    if why:
        assert chosen.fmt != fmt and chosen.dropped.get(fmt) == why, (fmt, why, chosen.fmt, chosen.dropped)
        assert why in kernels.describe_invariance(chosen)
        pytest.skip(f"{fmt} is not batch-invariant on this CPU and never offered here: it {why}")
    assert fmt not in chosen.dropped
    for past, by_way in position_logits(model, ids).items():  # and on the test's own text
        assert all_equal(differences(by_way)), (fmt, past, differences(by_way))


def test_the_check_fails_for_a_deliberately_row_dependent_kernel(embedded, ids, monkeypatch):
    model, _ = _prepared(embedded, "exact")
    real = OutputHead.__call__

    def row_dependent(self, hidden):  # a result that depends on how many rows are computed together
        logits = real(self, hidden)
        return logits * (1 + hidden.shape[0] * 2.0 ** -20)

    monkeypatch.setattr(OutputHead, "__call__", row_dependent)
    found = differences(position_logits(model, ids, PASTS[:1])[PASTS[0]])
    assert all(d[0] > 0 for d in found.values()), found
    assert invariance.verdict(invariance.check(model, pasts=PASTS[:1])).startswith("gave other logits in a tree of 2")


def test_the_chooser_runs_only_row_invariant_layouts_and_names_the_ones_it_left_out():
    counts = {"8x8": 2, "head": 1}
    timings = {(s, r, n): (0.5 if n == "linear" else 1.0) for s in counts for r in (1, 2, 4)
               for n in ("linear", "onednn")}
    plan = make_plan("exact", timings, counts, ("linear", "onednn"),
                     invariant={"8x8": ["onednn@2"], "head": ["onednn", "onednn@2"]})
    assert plan.invariant and plan.excluded == {"fp32": ["linear"]}
    assert plan.layouts["8x8"] == {1: "onednn@2", 2: "onednn", 4: "onednn"}  # faster F.linear is row-dependent here
    assert plan.layouts["head"] == {1: "onednn", 2: "onednn", 4: "onednn"}
    assert plan.layout_for("8x8", 500) == "onednn"  # beyond the timed rows: the same family
    # nothing row-invariant: the fastest layouts, and the plan says it is not invariant
    plain = make_plan("exact", timings, counts, ("linear", "onednn"), invariant={"8x8": [], "head": []})
    assert not plain.invariant and plain.layouts["8x8"][2] == "linear"
    assert "NOT batch-invariant" in kernels.describe_invariance(plain)


def test_the_row_invariance_probe_tells_a_row_dependent_layout_from_a_row_by_row_one(monkeypatch):
    from tr_core.speed import layouts

    real = layouts.LAYOUTS["linear"]
    shaky = Layout("linear", "fp32", "shaky", real.pack,
                   lambda x, w: torch.nn.functional.linear(x, w) * (1 + x.shape[0] * 2.0 ** -20), False)
    steady = Layout("wxt", "fp32", "row by row", real.pack,
                    lambda x, w: torch.cat([torch.nn.functional.linear(row[None], w) for row in x]), False)
    monkeypatch.setitem(layouts.LAYOUTS, "linear", shaky)
    monkeypatch.setitem(layouts.LAYOUTS, "wxt", steady)
    assert row_invariant({"64x32": (64, 32)}, ["linear", "wxt"]) == {"64x32": ["wxt", "wxt@2"]}


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_every_method_equals_plain_decoding_in_both_modes(embedded, mode):
    from tr_core.engine import Engine, EngineConfig

    model, tokenizer = embedded
    engine = Engine(copy.deepcopy(model), tokenizer, EngineConfig(mode=mode, tree="small"))
    prompts = ["Write a short story about a robot who learns to paint.",
               "Explain in three sentences why the sky is blue, then repeat the explanation."]
    for prompt in prompts:
        ids = engine.encode(prompt)
        plain = run(engine.model, ids, PlainDrafter(), 32, engine.eos_ids, head=engine.head).token_ids
        for drafter in (engine.drafter("tr"), engine.drafter("tr-context"), PromptLookupDrafter()):
            got = run(engine.model, ids, drafter, 32, engine.eos_ids, head=engine.head).token_ids
            assert got == plain, (mode, drafter.name, prompt)


def test_a_tree_crossing_an_attention_window_is_cut_at_its_end():
    from tr_core.tree import build_tree, cut_depth

    tree = build_tree([(0,), (1,), (0, 0), (0, 0, 0), (0, 0, 0, 0)])
    past = attention.BLOCK * 3 - 2  # two positions left in the window: the root and depth 1
    assert attention.window_room(past) == 1
    tokens, cut = cut_depth(torch.arange(tree.size), tree, attention.window_room(past))
    assert cut.max_depth == 1 and tokens.tolist() == [0, 1, 2]
    with pytest.raises(attention.WindowError):
        attention.row_keys(past, past + tree.depth, tree.mask)
    keys = attention.row_keys(past, past + cut.depth, cut.mask)
    assert keys.start == attention.BLOCK * 2 and keys.valid.sum(1).tolist() == [63, 64, 64]


def test_attend_equals_sdpa_to_float_tolerance():
    g = torch.Generator().manual_seed(0)
    for past, n in ((0, 30), (130, 5), (640, 40)):
        keys = torch.randn(1, 3, past + n, 64, generator=g)
        values = torch.randn(1, 3, past + n, 64, generator=g)
        q = torch.randn(1, 9, n, 64, generator=g)
        rows = attention.row_keys(past, torch.arange(past, past + n), None, group=3)
        torch.testing.assert_close(attention.attend(q, keys, values, rows, 0.125),
                                   attention.reference(q, keys, values, rows, 0.125), rtol=1e-5, atol=1e-5)


def test_a_decoding_step_at_a_windows_end_verifies_its_tree_cut_there(embedded):
    from tr_core.drafters import RecyclingDrafter
    from tr_core.engine import Engine, EngineConfig
    from tr_core.matrix import AdjacencyMatrix
    from tr_core.tree import load_template

    model, tokenizer = embedded
    engine = Engine(copy.deepcopy(model), tokenizer, EngineConfig(mode="exact", tree="small"))
    prompt = engine.encode(TEXT)[:attention.BLOCK * 2 - 1]  # the first root at position 126: room for depth 1
    tree = load_template("medium")
    drafter = RecyclingDrafter(AdjacencyMatrix(model.config.vocab_size, 8), tree)
    steps = list(decode(engine.model, prompt, drafter, 12, head=engine.head))
    assert steps[0].tree_name == f"{tree.name} cut at depth 1 at an attention window's end"
    assert max(_depths(steps[0].tree_parents)) == 1
    for e in steps:  # every step's tree within its root's window
        root = len(prompt) - 1 + e.total_tokens - len(e.new_tokens)
        assert max(_depths(e.tree_parents)) <= attention.window_room(root)
    plain = run(engine.model, prompt, PlainDrafter(), 12, head=engine.head).token_ids
    assert [t for e in steps for t in e.new_tokens] == plain


def _depths(parents: list[int]) -> list[int]:
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth
