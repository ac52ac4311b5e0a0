import os

import pytest
import torch
from conftest import reference_greedy, tiny_model

from tr_core.speed import chooser, kernels, layouts, stepbench
from tr_core.speed.chooser import prepare_model
from tr_core.speed.kernels import OutputHead, fp16_weights_available, mode_dtype
from tr_core.speed.layouts import LAYOUTS, available_layouts, choose_format, choose_layouts, linear_shapes, make_plan

# where this torch build has no fbgemm (not x86 or without AVX2), the fast mode has no fp16-weight linear to test
needs_fbgemm = pytest.mark.skipif(not fp16_weights_available(),
                                  reason="this torch build has no fbgemm fp16-weight linear")
# relative error of a product of unit-scale values, per format
ROUNDING = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 3e-2, "bf16p": 3e-2, "amx": 3e-2}


def test_output_head_equals_the_models_own_output_layer():
    for arch in ("llama", "gpt2"):
        model = tiny_model(arch, dtype=torch.float32)
        head = OutputHead(model)
        for n in (1, 2, 7):
            hidden = torch.randn(n, model.config.hidden_size if arch == "llama" else model.config.n_embd)
            torch.testing.assert_close(head(hidden), model.get_output_embeddings()(hidden), rtol=1e-5, atol=1e-5)


# --- the choice, from stubbed timings -------------------------------------------------------------------------

def stub(fastest: dict, shapes=("8x8",), rows=(1, 2, 4), layouts=("linear", "wxt", "xwt", "onednn", "fp16w")):
    """Timings where ``fastest[rows]`` (or ``fastest[None]``) takes 1 ms and every other layout 2 ms."""
    return {(s, r, name): 1.0 if name == fastest.get(r, fastest.get(None)) else 2.0
            for s in shapes for r in rows for name in layouts}


def test_the_chooser_picks_the_fastest_layout_per_shape_and_row_count():
    t = stub({1: "linear", 2: "wxt", 4: "onednn"}, shapes=("8x8", "16x8"))
    t[("16x8", 4, "xwt")] = 0.5
    chosen = choose_layouts(t, available=LAYOUTS)
    # 16x8 at 2 rows: xwt on 4 rows (0.5 ms, zero rows added) beats every layout on 2 rows (1 ms)
    assert chosen == {("16x8", 1): "linear", ("16x8", 2): "xwt@4", ("16x8", 4): "xwt",
                      ("8x8", 1): "linear", ("8x8", 2): "wxt", ("8x8", 4): "onednn"}


def test_a_row_count_is_computed_on_more_rows_only_where_that_is_faster_and_at_most_twice_as_many():
    t = {("8x8", 1, "linear"): 2.0, ("8x8", 2, "wxt"): 1.0, ("8x8", 4, "wxt"): 0.5}
    chosen = choose_layouts(t, available=LAYOUTS)
    assert chosen[("8x8", 1)] == "wxt@2"  # 4 rows would be faster still, but more than twice 1 row: not considered
    assert chosen[("8x8", 2)] == "wxt@4"
    t[("8x8", 2, "linear")] = 0.51  # within the tie band of the padded choice: the unpadded one wins
    assert choose_layouts(t, available=LAYOUTS)[("8x8", 2)] == "linear"
    from tr_core.speed.layouts import layout_label, layout_ms
    assert layout_ms(t, "8x8", 1, "wxt@2") == 1.0 and layout_label("wxt@2") == "(W @ x^T)^T on 2 rows (zero rows added)"


def test_a_padded_layout_gives_the_rows_it_was_called_with_equal_to_f_linear():
    from tr_core.speed.kernels import _runner
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(24, 16, generator=g), torch.randn(3, 16, generator=g)
    for name in ("wxt@4", "linear@6", "xwt@5"):
        run, packed = _runner(name, weight, {})
        out = run(x, packed)
        assert out.shape == (3, 24) and out.is_contiguous()
        torch.testing.assert_close(out, torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_a_tie_goes_to_the_layout_with_fewer_copies_and_noise_within_the_tie_band_is_a_tie():
    t = {("8x8", 2, "onednn"): 1.00, ("8x8", 2, "wxt"): 1.02, ("8x8", 2, "linear"): 1.10}
    assert choose_layouts(t, available=LAYOUTS) == {("8x8", 2): "wxt"}  # within 3% of the best: the cheaper layout
    t[("8x8", 2, "wxt")] = 1.05
    assert choose_layouts(t, available=LAYOUTS) == {("8x8", 2): "onednn"}  # beyond it: the fastest
    assert choose_layouts({("8x8", 1, "xwt"): 1.0, ("8x8", 1, "linear"): 1.0}, LAYOUTS) == {("8x8", 1): "linear"}


def test_a_layout_missing_on_this_platform_is_never_chosen():
    t = stub({None: "onednn"})
    assert set(choose_layouts(t, available=("linear", "wxt")).values()) <= {"linear", "wxt"}
    assert "onednn" not in choose_layouts(t, available=("linear", "wxt", "fp16w")).values()
    # the plan too: a format none of whose layouts this platform has is never the fast mode's format
    bf = {("8x8", r, "bf16-linear"): 0.1 for r in (1, 2, 4)}
    plan = make_plan("fast", {**stub({None: "linear"}), **bf}, {"8x8": 3}, available=("linear", "wxt", "fp16w"))
    assert plan.fmt in ("fp32", "fp16") and "bf16-linear" not in str(plan.layouts)


def test_exact_mode_chooses_only_fp32_layouts_and_fast_mode_the_fastest_format():
    t = stub({None: "linear"})
    t.update({("8x8", r, "fp16w"): 0.9 for r in (1, 2, 4)})
    t.update({("8x8", r, "bf16-onednn"): ms for r, ms in ((1, 1.2), (2, 0.3), (4, 0.3))})
    counts = {"8x8": 4}
    exact = make_plan("exact", t, counts, available=LAYOUTS)
    from tr_core.speed.layouts import base_layout
    assert exact.fmt == "fp32" and {LAYOUTS[base_layout(n)].fmt for c in exact.layouts.values()
                                    for n in c.values()} == {"fp32"}
    fast = make_plan("fast", t, counts, available=LAYOUTS)
    # one row runs as two (0.3 ms against 1.2): zero rows added
    assert fast.fmt == "bf16" and fast.layouts["8x8"] == {1: "bf16-onednn@2", 2: "bf16-onednn", 4: "bf16-onednn"}
    # the format is chosen on the whole step over the row counts (geometric mean), not on one row count
    fmt, steps = choose_format(t, counts, ("fp16", "bf16"), LAYOUTS)
    assert fmt == "bf16" and steps["fp16"][1] == pytest.approx(4 * 0.9) and steps["bf16"][2] == pytest.approx(1.2)
    assert steps["bf16"][1] == pytest.approx(1.2)  # the padded choice's time: that of 2 rows
    t.update({("8x8", r, "bf16-onednn"): 1.2 for r in (1, 2, 4)})
    assert make_plan("fast", t, counts, available=LAYOUTS).fmt == "fp16"
    # a tie between formats goes to the one with fp32 activations
    t.update({("8x8", r, "bf16-onednn"): 0.9 for r in (1, 2, 4)})
    assert make_plan("fast", t, counts, available=LAYOUTS).fmt == "fp16"


def test_with_the_methods_expected_tokens_the_fast_format_is_chosen_by_decoding_speed_and_says_so():
    from tr_core.speed.kernels import describe_format
    # fp16 weights: fastest at 1-4 rows, steep beyond; bf16: slower at one row, flat up to 32 rows
    t = {("8x8", r, "fp16w"): ms for r, ms in ((1, 1.0), (2, 1.1), (4, 1.3), (32, 6.0))}
    t.update({("8x8", r, "bf16-onednn"): ms for r, ms in ((1, 1.4), (2, 1.4), (4, 1.45), (32, 1.6))})
    counts = {"8x8": 2}
    by_step = make_plan("fast", t, counts, available=LAYOUTS)
    assert by_step.fmt == "fp16" and not by_step.speed
    few = {1: 1.0, 2: 1.3, 4: 1.5, 32: 1.6}  # trees barely pay: the fastest one-row step decodes fastest
    assert make_plan("fast", t, counts, available=LAYOUTS, gain=few).fmt == "fp16"
    many = {1: 1.0, 2: 1.6, 4: 2.2, 32: 4.0}  # a 32-node tree adds 4 tokens a step: bf16's flat cost wins
    plan = make_plan("fast", t, counts, available=LAYOUTS, gain=many)
    assert plan.fmt == "bf16" and plan.speed["bf16"][0] == 32 and plan.speed["fp16"][0] == 4
    said = describe_format(plan)
    ratio = plan.speed["bf16"][1] / plan.speed["fp16"][1]  # (4 / 3.2) / (2.2 / 2.6)
    assert "decoding speed" in said and "32 nodes for this one when it was chosen" in said
    assert f"{ratio:.2f}x faster than fp16 weights" in said


def test_row_counts_between_timed_ones_take_the_next_timed_choice_up_and_more_take_f_linear():
    plan = make_plan("exact", stub({1: "xwt", 2: "wxt", 4: "onednn"}), {"8x8": 1}, available=LAYOUTS)
    assert [plan.layout_for("8x8", r) for r in (1, 2, 3, 4, 5)] == ["xwt", "wxt", "onednn", "onednn", "linear"]


@pytest.mark.parametrize("fbgemm, bf16, fast", [
    (True, False, "fast: fp16 weights or fp32, whichever measures fastest here"),
    (True, True, "fast: fp16 weights or bf16 or fp32, whichever measures fastest here"),
    (False, False, "fast: fp32 (no fp16-weight kernel and no AVX-512 BF16/AMX on this CPU)")])
def test_what_a_mode_says_before_any_model_was_prepared(monkeypatch, fbgemm, bf16, fast):
    names = ("linear", "wxt") + (("fp16w",) if fbgemm else ()) + (("bf16-linear",) if bf16 else ())
    monkeypatch.setattr(layouts, "available_layouts", lambda: names)
    monkeypatch.setattr(kernels, "fp16_weights_available", lambda: fbgemm)
    monkeypatch.setattr(kernels, "_LATEST", {})
    assert mode_dtype("exact") == (torch.float32, "exact: fp32")
    assert mode_dtype("fast") == (torch.float32, fast)
    with pytest.raises(ValueError, match="exact, fast"):
        mode_dtype("turbo")


def test_the_fast_sentence_names_the_format_and_how_much_faster_it_measured():
    t = {("8x8", r, name): ms for r in (1, 16) for name, ms in (("linear", 4.0), ("fp16w", 2.0), ("bf16-linear", 1.0))}
    plan = make_plan("fast", t, {"8x8": 1}, available=LAYOUTS)
    said = kernels.describe_format(plan)
    assert said.startswith("fast: bf16 (") and (
        "chosen by measurement: linear layers 2.0x faster than fp16 weights, 4.0x than fp32 (steps of 1-16 tokens, "
        "geometric mean); NOT batch-invariant on this CPU") in said  # no invariance found: said so
    steady = make_plan("fast", t, {"8x8": 1}, available=LAYOUTS, invariant={"8x8": ["bf16-linear", "fp16w", "linear"]})
    said = kernels.describe_format(steady)
    assert "4.0x than fp32" in said and "; batch-invariant: each row's numbers are the same alone" in said
    left_out = said.split("left out as row-dependent here: ")[1].rstrip(")").split(", ")
    assert "(W @ x^T)^T" in left_out and "F.linear" not in left_out and "bf16 F.linear" not in left_out


# --- every layout computes the linear layer ---------------------------------------------------------------------

@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_equals_f_linear_within_its_formats_rounding(name):
    layout = LAYOUTS[name]
    if name not in available_layouts():
        pytest.skip(f"{layout.label} is not available on this platform")
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(80, 48, generator=g) / 48 ** 0.5
    dtype = layouts.FORMAT_DTYPE[layout.fmt]
    packed = layout.pack(weight.to(dtype))
    for rows in (1, 2, 3, 5, 8, 33, 81):
        x = torch.randn(rows, 48, generator=g)
        out = layout.run(x.to(dtype), packed)
        assert out.shape == (rows, 80) and out.is_contiguous() and out.dtype == dtype
        tol = ROUNDING[layout.fmt]
        torch.testing.assert_close(out.float(), torch.nn.functional.linear(x, weight), rtol=tol, atol=tol)


def plans_forcing_each_layout(model, mode):
    """For each available layout of the mode's formats, a plan choosing it for every shape and row count."""
    counts = {s: len(ls) for s, ls in linear_shapes(model).items()}
    for name in available_layouts():
        if LAYOUTS[name].fmt in layouts.mode_formats(mode):
            t = {(s, r, other): 1.0 if other == name else 2.0 for s in counts for r in (1, 2, 4, 8)
                 for other in available_layouts()}
            yield name, make_plan(mode, t, counts, available_layouts())


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 40])
def test_a_prepared_model_computes_what_the_model_computes_for_every_exact_layout(rows):
    reference = tiny_model("llama", dtype=torch.float32)
    ids = torch.randint(0, reference.config.vocab_size, (1, rows), generator=torch.Generator().manual_seed(rows))
    want = reference(input_ids=ids).logits
    for name, plan in plans_forcing_each_layout(reference, "exact"):
        model = tiny_model("llama", dtype=torch.float32)
        prepare_model(model, "exact", plan=plan)
        assert all(type(m) is not torch.nn.Linear for m in model.base_model.modules())
        hidden = model.base_model(input_ids=ids).last_hidden_state[0]
        torch.testing.assert_close(OutputHead(model)(hidden)[None], want, rtol=1e-4, atol=1e-4, msg=name)


def test_exact_greedy_decoding_through_each_chosen_layout_equals_plain_decoding():
    from tr_core.decoding import run
    from tr_core.drafters import PlainDrafter, RecyclingDrafter
    from tr_core.matrix import AdjacencyMatrix
    from tr_core.tree import load_template
    prompt = [3, 17, 42, 8, 99, 5]
    expected = reference_greedy(tiny_model("llama", dtype=torch.float32), prompt, 12)
    for name, plan in plans_forcing_each_layout(tiny_model("llama", dtype=torch.float32), "exact"):
        model = tiny_model("llama", dtype=torch.float32)
        prepare_model(model, "exact", plan=plan)
        assert prepare_model(model, "exact") is plan  # idempotent: prepared once
        assert run(model, prompt, PlainDrafter(), 12).token_ids == expected, name
        matrix = AdjacencyMatrix(model.config.vocab_size, 8)
        assert run(model, prompt, RecyclingDrafter(matrix, load_template("small")), 12).token_ids == expected, name


@pytest.mark.skipif("onednn" not in available_layouts(), reason="no oneDNN linear in this torch build")
def test_the_table_and_summary_say_what_was_chosen():
    model = tiny_model("llama", dtype=torch.float32)
    counts = {s: len(ls) for s, ls in linear_shapes(model).items()}
    t = {(s, r, name): 1.0 + (name != {1: "linear", 2: "wxt", 4: "wxt", 8: "onednn"}[r]) for s in counts
         for r in (1, 2, 4, 8) for name in ("linear", "wxt", "onednn")}
    prepare_model(model, "exact", plan=make_plan("exact", t, counts, ("linear", "wxt", "onednn")))
    table = kernels.kernel_table(model)
    assert len(table) == len(counts) * 4 and {row["shape"] for row in table} == set(counts)
    row = next(r for r in table if r["shape"] == "head" and r["rows"] == 2)
    assert row == {"shape": "head", "layers": 1, "rows": 2, "chosen": "wxt", "label": "(W @ x^T)^T",
                   "timings": {"linear": 2.0, "wxt": 1.0, "onednn": 2.0}}
    assert kernels.kernel_summary(model).startswith(
        "exact (fp32): body F.linear for 1 row, (W @ x^T)^T for 2-4, oneDNN prepacked for 5-8; output layer F.linear")
    assert kernels.kernel_table(tiny_model("llama")) == []  # float64: torch's own kernels


@pytest.mark.skipif("onednn" not in available_layouts(), reason="no oneDNN linear in this torch build")
@torch.inference_mode()
def test_a_model_on_onednn_prepacked_weights_can_be_deep_copied():
    """oneDNN's prepacked weights are opaque tensors that ``copy.deepcopy`` refuses; on a CPU without AVX-512 the
    chooser takes them, and a copy of such a prepared model failed ("Cannot access storage of OpaqueTensorImpl"). The
    copy packs them again: its own tensors, the same logits bit for bit, and the original untouched."""
    import copy

    model = tiny_model("llama", dtype=torch.float32)
    counts = {s: len(ls) for s, ls in linear_shapes(model).items()}
    t = {(s, r, name): 1.0 + (name != ("onednn" if r > 1 else "linear")) for s in counts for r in (1, 2, 8)
         for name in ("linear", "onednn")}
    prepare_model(model, "exact", plan=make_plan("exact", t, counts, ("linear", "onednn")))
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    before = model(ids).logits
    twin = copy.deepcopy(model)
    layers = [m for m in model.modules() if isinstance(m, kernels.ChosenLinear)]
    copies = [m for m in twin.modules() if isinstance(m, kernels.ChosenLinear)]
    assert layers and len(copies) == len(layers)
    for layer, other in zip(layers, copies):
        packed, again = layer.kernel_for(8)[1], other.kernel_for(8)[1]
        assert packed.layout == again.layout == torch._mkldnn and again is not packed
        assert other.weight is not layer.weight and torch.equal(other.weight, layer.weight)
        own = other.kernel_for(1)[1].data_ptr()  # F.linear reads the copy's own weight
        assert own == other.weight.data_ptr() != layer.weight.data_ptr()
    assert torch.equal(twin(ids).logits, before) and torch.equal(model(ids).logits, before)


def test_the_timings_are_measured_once_per_machine_and_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    busy = [False]

    def fake_measure(model, names, report_busy, **kw):
        calls.append(list(names))
        return {(s, r, n): 1.0 for s in linear_shapes(model) for r in (1, 2) for n in names}, busy[0]
    monkeypatch.setattr(layouts, "measure", fake_measure)
    model = tiny_model("llama", dtype=torch.float32)
    first = layouts.kernel_plan(model, "exact")
    second = layouts.kernel_plan(model, "exact")
    assert len(calls) == 1 and all(LAYOUTS[n].fmt == "fp32" for n in calls[0])
    assert first.source == "measured here" and second.source == "cached" and first.layouts == second.layouts
    assert len(list((tmp_path / "token-recycling" / "kernels").glob("*.json"))) == 1
    layouts.kernel_plan(model, "fast")  # another mode, other candidates: measured apart
    assert len(calls) == 2
    # timings taken while other processes competed for the cores are used but not cached
    busy[0] = True
    noisy = tiny_model("llama", dtype=torch.float32)
    noisy.config._name_or_path = "another"
    assert "busy" in layouts.kernel_plan(noisy, "exact").source and "busy" in layouts.kernel_plan(noisy, "exact").source
    assert len(calls) == 4 and len(list((tmp_path / "token-recycling" / "kernels").glob("*.json"))) == 2


def test_the_exact_mode_reads_the_fast_modes_timings_of_its_layouts_instead_of_timing_them_again(monkeypatch,
                                                                                                   tmp_path):
    # the fast mode's rounds time the fp32 layouts too (its candidates include the exact mode's): measured fast
    # first, exact reads them, its own layouts only, and says where they came from
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def fake_measure(model, names, report_busy, **kw):
        calls.append(list(names))
        return {(s, r, n): 1.0 + (n == "linear") for s in linear_shapes(model) for r in (1, 2) for n in names}, False
    monkeypatch.setattr(layouts, "measure", fake_measure)
    model = tiny_model("llama", dtype=torch.float32)
    fast = layouts.plan_inputs(model, "fast")
    exact = layouts.plan_inputs(model, "exact")
    assert len(calls) == 1 and {LAYOUTS[n].fmt for n in calls[0]} > {"fp32"}  # measured once, with every format
    assert exact["source"] == "cached, timed with the fast mode's candidates"
    fp32 = [n for n in calls[0] if LAYOUTS[n].fmt == "fp32"]
    assert exact["available"] == fp32 and {n for _, _, n in exact["timings"]} == set(fp32)
    assert exact["timings"] == {k: v for k, v in fast["timings"].items() if k[2] in fp32}
    assert all(layouts.base_layout(f) in fp32 for families in exact["invariant"].values() for f in families)
    assert layouts.make_plan("exact", **{k: v for k, v in exact.items()}).fmt == "fp32"
    # measured the other way round, the exact mode's own timings cannot serve the fast mode: it measures
    other = tiny_model("llama", dtype=torch.float32)
    other.config._name_or_path = "another"
    layouts.plan_inputs(other, "exact")
    layouts.plan_inputs(other, "fast")
    every = len({LAYOUTS[n].fmt for n in calls[0]})
    assert [len({LAYOUTS[n].fmt for n in c}) for c in calls[1:]] == [1, every]
    # unless both modes are asked for at once (the app's start): the exact mode, prepared first, times the fast
    # mode's candidates, cached as the fast mode's, and the fast mode reads them
    third = tiny_model("llama", dtype=torch.float32)
    third.config._name_or_path = "a third"
    with layouts.every_mode_at_once():
        exact = layouts.plan_inputs(third, "exact")
        fast = layouts.plan_inputs(third, "fast")
    assert len(calls) == 4 and len({LAYOUTS[n].fmt for n in calls[3]}) == every
    assert exact["source"] == "cached, timed with the fast mode's candidates" and fast["source"] == "cached"
    assert exact["timings"] == {k: v for k, v in fast["timings"].items() if k[2] in fp32}
    assert not layouts._EVERY_MODE  # put back


def test_measuring_times_every_shape_row_count_and_layout():
    model = tiny_model("llama", dtype=torch.float32)
    names = [n for n in available_layouts() if LAYOUTS[n].fmt == "fp32"]
    t = layouts.measure(model, names, rows=(1, 3), rounds=1)
    assert set(t) == {(s, r, n) for s in linear_shapes(model) for r in (1, 3) for n in names}
    assert all(ms > 0 for ms in t.values())


@pytest.mark.parametrize("name", ["fp16w", "fp16n"])
def test_the_fp16_format_rounds_only_the_weights_and_stays_greedy(name):
    if name not in available_layouts():
        pytest.skip(f"{name} does not run here")
    from tr_core.decoding import run
    from tr_core.drafters import PlainDrafter, RecyclingDrafter
    from tr_core.matrix import AdjacencyMatrix
    from tr_core.speed.kernels import ChosenLinear
    from tr_core.tree import load_template
    model = tiny_model("llama", dtype=torch.float32)
    counts = {s: len(ls) for s, ls in linear_shapes(model).items()}
    plan = make_plan("fast", {(s, r, name): 1.0 for s in counts for r in (1, 4, 8)}, counts, (name,),
                     invariant={s: [name] for s in counts})  # one layout at every row count
    w16 = model.get_output_embeddings().weight.detach().half().float()
    prompt = [3, 17, 42, 8, 99, 5]
    count = sum(p.numel() for p in model.parameters())
    prepare_model(model, "fast", plan=plan)
    assert plan.fmt == "fp16" and kernels.plan_of(model).fmt == "fp16"  # the body's fp32 weights are gone
    layer = model.base_model.layers[0].mlp.up_proj
    assert isinstance(layer, ChosenLinear) and layer.weight is None  # the fp32 weight is not kept
    # but counted: the model details and the step-cost model's weights read a step (seen as 28M of 135M before)
    assert sum(p.numel() for p in model.parameters()) < count == kernels.parameter_count(model)
    from tr_core.speed.calibrate import streamed_parameters
    assert streamed_parameters(model) == count - (0 if model.config.tie_word_embeddings else
                                                  model.get_input_embeddings().weight.numel())
    assert layer.layouts == [name]
    hidden = torch.randn(3, model.config.hidden_size)
    torch.testing.assert_close(OutputHead(model)(hidden), hidden @ w16.t(), rtol=1e-5, atol=1e-5)
    x = torch.randn(8, layer.in_features)  # a row computes the same alone and in a batch, to float rounding
    torch.testing.assert_close(layer(x), torch.cat([layer(x[i:i + 1]) for i in range(8)]), rtol=1e-5, atol=1e-5)
    expected = reference_greedy(model, prompt, 12)  # transformers' generate on the packed model
    assert run(model, prompt, PlainDrafter(), 12).token_ids == expected
    matrix = AdjacencyMatrix(model.config.vocab_size, 8)
    assert run(model, prompt, RecyclingDrafter(matrix, load_template("small")), 12).token_ids == expected


@pytest.mark.skipif("bf16-linear" not in available_layouts(), reason="no native bf16 (AVX-512 BF16/AMX) here")
def test_the_bf16_format_converts_the_model_and_computes_within_bf16_rounding():
    model = tiny_model("llama", dtype=torch.float32)
    reference = tiny_model("llama", dtype=torch.float32)
    counts = {s: len(ls) for s, ls in linear_shapes(model).items()}
    names = [n for n in available_layouts() if LAYOUTS[n].fmt == "bf16"]
    for name in names:
        t = {(s, r, n): 1.0 if n == name else 2.0 for s in counts for r in (1, 4) for n in names}
        model = tiny_model("llama", dtype=torch.float32)
        prepare_model(model, "fast", plan=make_plan("fast", t, counts, names))
        assert model.dtype == torch.bfloat16 and kernels.plan_of(model).fmt == "bf16"
        ids = torch.tensor([[1, 5, 9, 2]])
        hidden = model.base_model(input_ids=ids).last_hidden_state[0]
        want = reference(input_ids=ids).logits[0]
        got = OutputHead(model)(hidden).float()
        assert (got - want).abs().max() < 0.1 * want.abs().max(), name


def test_cpu_models_attend_with_grouped_query_heads_under_a_tree_mask():
    import os

    from transformers.integrations.sdpa_attention import use_gqa_in_sdpa

    from tr_core.speed.kernels import GQA_SWITCH
    model = tiny_model("llama", dtype=torch.float32)
    prepare_model(model, "exact")
    assert os.environ.get(GQA_SWITCH) == "1"
    key = value = torch.zeros(1, 2, 10, 16)
    mask = torch.zeros(1, 1, 3, 10)
    assert use_gqa_in_sdpa(mask, key, value), "transformers no longer reads the switch: tree steps copy the cache"


def test_the_format_is_chosen_on_the_row_counts_a_cpu_decodes_with():
    # fp16 weights faster up to 8 rows, bf16 from 12 on, by far at 81: the fast mode keeps fp16 (FORMAT_MAX_ROWS)
    t = {("8x8", r, "fp16w"): float(r) for r in (1, 2, 4, 8, 12, 16, 32, 81)}
    t.update({("8x8", r, "bf16-linear"): 3 + r / 2 for r in (1, 2, 4, 8, 12, 16, 32, 81)})
    assert choose_format(t, {"8x8": 1}, ("fp16", "bf16"), LAYOUTS)[0] == "fp16"
    t.update({("8x8", r, "bf16-linear"): 0.9 * r for r in (1, 2, 4, 8, 12, 16, 32, 81)})
    assert choose_format(t, {"8x8": 1}, ("fp16", "bf16"), LAYOUTS)[0] == "bf16"


def _mapped_from(path, tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory lies in a mapping of the file ``path`` (/proc/self/maps)."""
    start, name = tensor.untyped_storage().data_ptr(), str(path)
    for line in open("/proc/self/maps"):
        fields = line.split()
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if low <= start < high:
            return len(fields) >= 6 and fields[5] == name
    return False


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux's /proc/self/maps")
def test_a_prepared_model_keeps_no_weight_in_the_mapped_file(tiny_folder):
    """transformers reads safetensors weights as views of the file mapped into memory; prepare_model copies them first,
    so the pages it reads there do not stay in the process's memory beside the copies it makes (the fused projections,
    packed weights). Ties are kept."""
    from tr_core.models import load_model

    folder = tiny_folder[0]
    model, _ = load_model(str(folder))
    file = (folder / "model.safetensors").resolve()
    mapped = [name for name, p in model.named_parameters() if _mapped_from(file, p)]
    assert mapped, "the control: the loaded weights are views of the mapped file"
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    values = {name: p.detach().clone() for name, p in model.named_parameters()}
    chooser.own_weights(model)
    assert not [name for name, p in model.named_parameters() if _mapped_from(file, p)]
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    assert all(torch.equal(p, values[name]) for name, p in model.named_parameters())
    model, _ = load_model(str(folder))
    counts = {s: len(ls) for s, ls in linear_shapes(model).items()}
    t = {(s, r, "linear"): 1.0 for s in counts for r in (1, 2, 4, 8)}
    prepare_model(model, "exact", plan=make_plan("exact", t, counts, ("linear",)))
    assert not [name for name, p in model.named_parameters() if _mapped_from(file, p)]


def test_a_cached_plan_keeps_only_the_layouts_that_run_here(tmp_path, monkeypatch):
    """A cache folder copied from another machine (same CPU name, say a VM without AVX-512) may name a layout that
    does not run here: the plan read from it leaves that layout out, whatever its timings."""
    import json

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = tiny_model("llama", dtype=torch.float32)
    shapes = list(linear_shapes(model))
    path = layouts.cache_path(model, "exact")
    path.parent.mkdir(parents=True, exist_ok=True)
    timings = [[s, r, name, ms] for s in shapes for r in layouts.ROW_COUNTS
               for name, ms in (("linear", 2.0), ("gone", 1.0))]
    path.write_text(json.dumps({"available": ["linear", "gone"], "invariant": {s: ["linear", "gone"] for s in shapes},
                                "timings": timings}))
    plan = layouts.kernel_plan(model, "exact")
    assert plan.source == "cached"
    assert {name for by in plan.layouts.values() for name in by.values()} == {"linear"}


# --- the fast format, chosen on whole steps ----------------------------------------------------------------------

def _stub_linear_times(monkeypatch, ms: dict[str, float]):
    """Every layout of ``ms`` available, row-invariant (and every format's whole model: ``invariance.check``), and
    timed at ``ms[layout]`` for every shape and row count."""
    from tr_core.speed import invariance
    monkeypatch.setattr(layouts, "available_layouts", lambda: tuple(ms))
    monkeypatch.setattr(layouts, "row_invariant", lambda shapes, names: {s: list(names) for s in shapes})
    monkeypatch.setattr(invariance, "check", lambda model, ids=None, pasts=invariance.PASTS: {})

    def fake_measure(model, names, report_busy, **kw):
        return {(s, r, n): ms[n] for s in linear_shapes(model) for r in (1, 2, 4, 16) for n in names}, False
    monkeypatch.setattr(layouts, "measure", fake_measure)


@needs_fbgemm
def test_the_fast_format_is_chosen_on_whole_steps_not_on_the_linear_layers_alone(monkeypatch, tmp_path):
    """bf16 wins on the linear layers' times, but its whole step (the small operations between them run in torch)
    is the slowest: fp16 weights are chosen, on step times measured on copies of the model prepared per format."""

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _stub_linear_times(monkeypatch, {"linear": 4.0, "fp16w": 2.0, "bf16-linear": 1.5})
    model = tiny_model("llama", dtype=torch.float32)
    assert layouts.kernel_plan(model, "fast").fmt == "bf16"  # the linear layers' choice
    trials = []

    def fake_whole(models, sizes, **kw):
        trials.append(({name: (kernels.plan_of(m).fmt, m.dtype) for name, m in models.items()}, sizes,
                       kernels.plan_of(model)))
        ms = {"fp32": 8.0, "fp16": 5.0, "bf16": 12.0}
        return {name: {n: ms[name] * (1 + n / 16) for n in sizes} for name in models}, False
    monkeypatch.setattr(stepbench, "whole_steps_ms", fake_whole)
    plan = prepare_model(model, "fast")
    assert plan.fmt == "fp16" and model.dtype == torch.float32 and kernels.plan_of(model).fmt == "fp16"
    copies, sizes, original = trials[0]
    assert copies == {"bf16": ("bf16", torch.bfloat16), "fp16": ("fp16", torch.float32),
                      "fp32": ("fp32", torch.float32)}
    assert original is None  # the model itself is prepared once, after the trials, with the plan chosen
    assert sizes == (1, 2, 4, 8, 16)  # no expected tokens for a random model: the row counts a CPU decodes with
    assert plan.whole_ms["bf16"][1] == 12.0 * (1 + 1 / 16)
    said = kernels.describe_format(plan)
    assert "chosen by measurement: whole steps 1.6x faster than fp32, 2.4x than bf16 (steps of 1-16 tokens" in said
    # measured once per machine, model, mode and plans: a second model reads the cache
    again = tiny_model("llama", dtype=torch.float32)
    assert prepare_model(again, "fast").fmt == "fp16" and len(trials) == 1


@needs_fbgemm
def test_a_close_call_between_formats_times_every_format_again(monkeypatch, tmp_path):
    """fp16 weights and bf16 come out within 10% in the first rounds (fp32 far behind): every format is timed in
    more rounds, added to the first ones (``pool``), and the reading over all of them decides (every format in every
    round: the machine may slow down in between); the plan says so, and so does the cache."""

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _stub_linear_times(monkeypatch, {"linear": 4.0, "fp16w": 2.0, "bf16-linear": 1.5})
    trials = []

    def fake_whole(models, sizes, **kw):
        trials.append((sorted(models), kw.get("repeats"), kw.get("pool")))
        ms = {"fp32": 8.0, "fp16": 5.0, "bf16": 5.3} if len(trials) == 1 else {"fp32": 9.0, "fp16": 6.0, "bf16": 4.8}
        return {name: {n: ms[name] * (1 + n / 16) for n in sizes} for name in models}, False
    monkeypatch.setattr(stepbench, "whole_steps_ms", fake_whole)
    model = tiny_model("llama", dtype=torch.float32)
    plan = prepare_model(model, "fast")
    more = layouts.CLOSE_ROUNDS - layouts.FIRST_ROUNDS
    assert [t[:2] for t in trials] == [(["bf16", "fp16", "fp32"], layouts.FIRST_ROUNDS),
                                       (["bf16", "fp16", "fp32"], more)]
    assert isinstance(trials[0][2], dict) and trials[0][2] is trials[1][2]  # the second continues the first's rounds
    assert plan.fmt == "bf16" and {fmt: by[1] for fmt, by in plan.whole_ms.items()} == {
        "fp32": 9.0 * (1 + 1 / 16), "fp16": 6.0 * (1 + 1 / 16), "bf16": 4.8 * (1 + 1 / 16)}  # over all rounds
    said = kernels.describe_format(plan)
    assert (f"a close call between fp16 weights and bf16 (within 10% in the first {layouts.FIRST_ROUNDS} rounds): "
            f"every format timed in {more} more, and chosen on all {layouts.CLOSE_ROUNDS}") in said
    again = tiny_model("llama", dtype=torch.float32)  # the cache keeps the second reading and the note
    plan = prepare_model(again, "fast")
    assert plan.fmt == "bf16" and len(trials) == 2 and "a close call between fp16 weights and bf16" in \
        kernels.describe_format(plan)


@needs_fbgemm
def test_with_expected_tokens_a_flat_whole_step_wins_on_decoding_speed(monkeypatch, tmp_path):
    from tr_core.speed.lean import fuse

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _stub_linear_times(monkeypatch, {"fp16w": 1.0, "bf16-linear": 1.5})

    def fake_whole(models, sizes, **kw):  # fp16: fastest alone, steep; bf16: slower alone, flat
        curve = {"fp16": lambda n: 5.0 * (1 + n / 4), "bf16": lambda n: 6.0, "fp32": lambda n: 9.0 * (1 + n / 4)}
        return {name: {n: curve[name](n) for n in sizes} for name in models}, False
    monkeypatch.setattr(stepbench, "whole_steps_ms", fake_whole)
    model = tiny_model("llama", dtype=torch.float32)
    fuse(model)
    gain = {1: 1.0, 2: 1.5, 4: 2.0, 8: 2.5, 16: 3.0, 32: 3.5, 81: 4.0}
    plan = chooser.choose_plan(model, "fast", gain=gain)
    assert plan.fmt == "bf16" and set(plan.whole_ms["bf16"]) == set(chooser.WHOLE_SIZES)
    # fp16's best: 2 nodes, 1.5 tokens in 7.5 ms (1 in 6.25 ms alone, 2 in 10 ms at 4 nodes)
    assert plan.speed["bf16"] == (81, 4.0 / 6.0) and plan.speed["fp16"] == (2, 1.5 / 7.5)
    said = kernels.describe_format(plan)
    assert ("expected tokens per ms of a whole step, each format at its best tree size: 81 nodes for this one when "
            "it was chosen") in said
    assert f"{(4.0 / 6.0) / (1.5 / 7.5):.2f}x faster than fp16 weights" in said


@needs_fbgemm
def test_without_memory_for_the_copies_the_linear_layers_choose_and_the_sentence_says_so(monkeypatch, tmp_path):

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _stub_linear_times(monkeypatch, {"linear": 4.0, "fp16w": 2.0, "bf16-linear": 1.5})
    monkeypatch.setattr(chooser, "available_memory_bytes", lambda: 2**20)
    monkeypatch.setattr(stepbench, "whole_steps_ms", lambda *a, **k: pytest.fail("no copies without the memory"))
    model = tiny_model("llama", dtype=torch.float32)
    plan = prepare_model(model, "fast")
    assert plan.fmt == "bf16" and not plan.whole_ms
    said = kernels.describe_format(plan)
    assert "linear layers 1.3x faster than fp16 weights" in said
    assert "chosen on the linear layers' times alone: timing each format's whole step needs" in said


@needs_fbgemm
def test_a_cold_choice_checks_and_times_one_copy_of_each_format(monkeypatch, tmp_path):
    """The invariance check and the whole steps use the same prepared copy of a format (``chooser.Trials``): each
    format is copied and packed once a choice, not once for each; without the memory for all of them at once, each
    copy goes after its check and the linear layers choose."""
    from tr_core.speed import invariance

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _stub_linear_times(monkeypatch, {"linear": 4.0, "fp16w": 2.0, "bf16-linear": 1.5})
    prepared, checked, timed = [], [], []
    real_apply = chooser.apply_plan

    def counted_apply(model, plan):
        prepared.append(plan.fmt)
        return real_apply(model, plan)

    def fake_check(model, ids=None, pasts=invariance.PASTS):
        checked.append((kernels.plan_of(model).fmt, id(model)))
        return {}

    def fake_whole(models, sizes, **kw):
        timed.extend((fmt, id(m)) for fmt, m in models.items())
        return {fmt: {n: {"fp32": 8.0, "fp16": 5.0, "bf16": 12.0}[fmt] for n in sizes} for fmt in models}, False
    monkeypatch.setattr(chooser, "apply_plan", counted_apply)
    monkeypatch.setattr(invariance, "check", fake_check)
    monkeypatch.setattr(stepbench, "whole_steps_ms", fake_whole)
    model = tiny_model("llama", dtype=torch.float32)
    plan = chooser.choose_plan(model, "fast")
    assert plan.fmt == "fp16" and sorted(prepared) == ["bf16", "fp16", "fp32"]  # one copy a format
    assert sorted(checked) == sorted(timed)  # the copies checked are the copies timed
    assert kernels.plan_of(model) is None
    # no memory to hold them all: each copy goes after its check, and the whole steps are not timed
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "small"))
    monkeypatch.setattr(chooser, "available_memory_bytes", lambda: 2**20)
    prepared.clear()
    plan = chooser.choose_plan(tiny_model("llama", dtype=torch.float32), "fast")
    assert sorted(prepared) == ["bf16", "fp16", "fp32"] and len(timed) == 3 and plan.fmt == "bf16"


def test_a_second_reading_adds_its_rounds_to_the_first_ones(monkeypatch):
    """``whole_steps_ms``' ``pool``: the second call times more rounds of the same benches (built once, no second
    warm-up) and returns t(N) over every round of both, every model in every round, the order still turning."""
    built, order = [], []

    class Counted(stepbench.StepBench):
        def __init__(self, model, sizes, prefix):
            super().__init__(model, sizes, prefix)
            self.number = len(built)
            built.append(model)

        def time_round(self, block):
            order.append(self.number)
            return {n: [float(len(order) + n)] * block for n in self.sizes}

    monkeypatch.setattr(stepbench, "StepBench", Counted)
    models = {"a": tiny_model("llama", dtype=torch.float32), "b": tiny_model("llama", seed=1, dtype=torch.float32)}
    pool = {}
    stepbench.whole_steps_ms(models, (1, 2), prefix=8, repeats=1, pool=pool)
    assert len(built) == 2 and order == [0, 1, 1, 0]  # a warm-up round, then one counted (the order turned)
    steps, _ = stepbench.whole_steps_ms(models, (1, 2), prefix=8, repeats=2, pool=pool)
    assert len(built) == 2 and order == [0, 1, 1, 0, 0, 1, 1, 0]  # two more rounds, no warm-up, still turning
    assert {name: [len(r) for r in t.values()] for name, t in pool["times"].items()} == {"a": [3, 3], "b": [3, 3]}
    assert steps == {name: stepbench.paired_curve(t) for name, t in pool["times"].items()}


def test_whole_steps_are_timed_on_prepared_copies_and_leave_the_model_as_it_was():
    from tr_core.speed.lean import fuse

    model = tiny_model("llama", dtype=torch.float32)
    fuse(model)
    before = {name: p.clone() for name, p in model.named_parameters()}
    plans = layouts.format_plans(model, "fast")
    steps, why, _ = chooser.whole_steps(model, plans, (1, 4), cache=False)
    assert set(steps) == set(plans) and why.startswith("measured here")
    assert all(set(by) == {1, 4} and 0 < by[1] <= by[4] for by in steps.values())
    assert kernels.plan_of(model) is None and all(type(m) is not kernels.ChosenLinear for m in model.modules())
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


@needs_fbgemm
def test_a_format_whose_whole_model_is_not_batch_invariant_is_never_offered(monkeypatch, tmp_path):
    """fp16 weights win on every timing, but their prepared model fails ``invariance.check`` (stubbed): the chooser
    drops them, runs the next format, and says why; where every format fails, the plan says it is not invariant."""
    from tr_core.speed import invariance

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _stub_linear_times(monkeypatch, {"linear": 4.0, "fp16w": 2.0, "bf16-linear": 3.0})
    failing = {"fp16"}
    checked = []

    def fake_check(model, ids=None, pasts=invariance.PASTS):
        fmt = kernels.plan_of(model).fmt
        checked.append(fmt)
        return {130: {"tree of 2": [0, 0], "prefill in 7s": [0, 5, 0, 0] if fmt in failing else [0, 0, 0, 0]}}
    monkeypatch.setattr(invariance, "check", fake_check)
    monkeypatch.setattr(stepbench, "whole_steps_ms", lambda models, sizes, **kw: (
        {name: {n: {"fp32": 8.0, "fp16": 4.0, "bf16": 6.0}[name] for n in sizes} for name in models}, False))
    plan = prepare_model(tiny_model("llama", dtype=torch.float32), "fast")
    assert sorted(checked) == ["bf16", "fp16", "fp32"]
    why = "gave other logits in a prefill in 7s than alone (at a 130-token past: [0, 5, 0, 0] differing)"
    assert plan.fmt == "bf16" and plan.invariant and plan.dropped == {"fp16": why}
    assert f"the fp16 weights format, whose whole model {why}" in kernels.describe_invariance(plan)
    # the verdicts are cached per machine: a second model is not checked again
    assert prepare_model(tiny_model("llama", dtype=torch.float32), "fast").fmt == "bf16" and len(checked) == 3
    failing.update({"fp32", "bf16"})
    exact = prepare_model(tiny_model("llama", dtype=torch.float32), "exact")
    assert not exact.invariant and exact.dropped == {"fp32": why}
    assert kernels.describe_invariance(exact).startswith(
        f"NOT batch-invariant on this CPU: checked whole, the model {why}")
