"""Fitting the tree to the hardware: the choice follows the cost curve and the acceptance statistics."""

import pytest
from conftest import tiny_model

from tr_core import AdjacencyMatrix, RecyclingDrafter, load_template, run
from tr_core.fitting import fit_tree, node_acceptance
from tr_core.speed.calibrate import interpolate, measure_forward_ms


def fake_acceptance(tree):
    # likelier for low ranks and shallow nodes; a child never beats its parent
    acc = [1.0] * tree.size
    for i in range(1, tree.size):
        acc[i] = acc[int(tree.parents[i])] * (0.6 / (1 + int(tree.ranks[i])))
    return acc


def test_flat_cost_takes_the_whole_tree_and_steep_cost_a_small_one():
    paper = load_template("paper")
    acc = fake_acceptance(paper)
    flat = fit_tree(paper, acc, {1: 10.0, 81: 10.0})
    assert flat.tree.size == 81
    steep = fit_tree(paper, acc, {1: 10.0, 2: 11.0, 4: 13.0, 8: 20.0, 16: 40.0, 81: 200.0})
    assert 2 <= steep.tree.size <= 8
    # the fitted tree's predicted speedup is the best row of its table
    assert steep.predicted_speedup == pytest.approx(max(r["predicted_speedup"] for r in steep.table))
    # expected accepted = 1 + the acceptance of the chosen nodes
    chosen = {p for p in steep.tree.node_paths[1:]}
    want = 1 + sum(a for p, a in zip(paper.node_paths, acc) if p in chosen)
    assert steep.expected_accepted == pytest.approx(want)
    # the likeliest nodes are the rank-0 chain's start
    assert (0,) in chosen


def test_interpolate():
    curve = {1: 10.0, 5: 30.0}
    assert interpolate(curve, 1) == 10 and interpolate(curve, 3) == 20 and interpolate(curve, 9) == 30


def test_node_acceptance_counts_the_accepted_path():
    model = tiny_model("llama", seed=4)
    tree = load_template("small")
    result = run(model, list(range(10, 30)), RecyclingDrafter(AdjacencyMatrix(256, 8), tree), 24)
    acc = node_acceptance(result.events, tree)
    assert acc[0] == 1.0 and len(acc) == tree.size
    on_path = sum(len(e.accepted_path) for e in result.events) / len(result.events)
    assert sum(acc) == pytest.approx(on_path)


def test_calibration_measures_every_size():
    model = tiny_model("qwen2", seed=5)
    curve = measure_forward_ms(model, sizes=(1, 4, 16), prefix=16, repeats=1, use_cache_file=False)
    assert sorted(curve) == [1, 4, 16] and all(t > 0 for t in curve.values())


def test_a_short_context_model_is_calibrated_on_the_longest_cache_that_fits(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = tiny_model("gpt2", seed=5)  # learned positions: n_positions bounds the cache
    limit = model.config.n_positions
    curve = measure_forward_ms(model, sizes=(1, 4), prefix=limit + 500, repeats=1)
    assert sorted(curve) == [1, 4]
    files = list((tmp_path / "token-recycling" / "calibration").glob("*.json"))
    assert len(files) == 1 and files[0].name.endswith(f"-p{limit - 4 - 1}-paired.json")


def test_context_weights_split_each_context_between_the_grid_points_around_it():
    from tr_core.speed.calibrate import context_weights

    assert context_weights([256]) == {256: 1.0}
    assert context_weights([384], grid=(128, 256, 512)) == {256: 0.5, 512: 0.5}
    # clamped at the ends; weights are shares of the contexts
    assert context_weights([10, 5000], grid=(128, 256)) == {128: 0.5, 256: 0.5}
    w = context_weights([192, 1024, 300], grid=(128, 256, 512, 1024))
    assert abs(sum(w.values()) - 1) < 1e-12 and w[1024] == pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        context_weights([])


def test_t_n_over_many_contexts_is_the_weighted_mean_of_their_calibrations(monkeypatch):
    from tr_core.speed import calibrate

    fake = {128: {1: 10.0, 4: 12.0}, 256: {1: 20.0, 4: 30.0}}
    monkeypatch.setattr(calibrate, "measure_forward_ms", lambda model, prefix, **kw: fake[prefix])
    assert calibrate.context_curve(None, 128) == fake[128]
    mixed = calibrate.context_curve(None, (128, 192, 256, 256))  # weights: 128 -> 3/8, 256 -> 5/8
    # context_weights uses the module's grid, whose first two points are 128 and 256
    assert mixed == pytest.approx({1: 10 * 3 / 8 + 20 * 5 / 8, 4: 12 * 3 / 8 + 30 * 5 / 8})


def test_the_fit_context_must_be_token_counts():
    from tr_core.engine import EngineConfig

    assert EngineConfig(fit_context=(100, 900)).fit_context == (100, 900)
    for bad in (0, (), (100, 0), [256], "256"):
        with pytest.raises(ValueError, match="fit_context"):
            EngineConfig(fit_context=bad)


def test_one_slow_block_of_one_token_steps_does_not_lift_the_larger_sizes():
    from tr_core.speed.calibrate import paired_curve

    # rounds 1-4: t(4) = 1.2 t(1); round 0's one-token block ran in a slow spell (30 ms against 20)
    times = {1: [[30.0, 30.0]] + [[20.0, 20.0]] * 4, 4: [[24.0, 24.0]] * 5, 8: [[30.0, 30.0]] * 5}
    curve = paired_curve(times)
    assert curve[1] == 20.0 and curve[4] == pytest.approx(24.0) and curve[8] == pytest.approx(30.0)
    # three rounds of five in a slow spell (every size 1.5x): the ratio taken within each round stays 1.2
    slow = {1: [[30.0]] * 3 + [[20.0]] * 2, 4: [[36.0]] * 3 + [[24.0]] * 2}
    assert paired_curve(slow)[4] / paired_curve(slow)[1] == pytest.approx(1.2)


def test_the_limits_line_sets_the_16_row_pass_against_the_least_this_cpu_allows():
    """calibrate --show's line: the plain step against streaming, and t(16)/t(1) against the ratio of the floors that
    the streaming and the CPU's measured peak set (stubbed numbers); without a peak, no floor is claimed."""
    from tr_core.speed.calibrate import limits_line, step_floor_ms
    rounds = [(20.0, 10.0, 25.0)] * 3  # (GB/s, t(1), t(16)): three alike rounds
    # 100 MB at 20 GB/s: 5 ms of streaming; 16 rows of 50 M products at 100 G/s: 8 ms
    line = limits_line("fast", "bf16p", rounds, 100_000_000, 50_000_000, 1e11, "native")
    assert "stream in 5.0 ms at 20.0 GB/s (read in the same rounds: 20.0-20.0)" in line
    assert "2.0x its streaming time (2.0-2.0 round by round)" in line and "t(16)/t(1) = 2.50 (t(16) 25.0 ms)" in line
    assert "against 1.60 were both passes at their floors here (one row: 5.0 ms" in line
    assert "peak of 100 G bf16 dot products a second" in line
    assert "8.0 ms; t(16) is 3.12x its floor" in line  # 25 / 8
    assert step_floor_ms(16, 5.0, 50_000_000, 1e11) == pytest.approx(8.0)
    assert step_floor_ms(2, 5.0, 50_000_000, 1e11) == 5.0  # two rows' products hide behind the streaming
    bare = limits_line("exact", "fp32", rounds, 100_000_000, 50_000_000, None, "torch")
    assert "floor" not in bare and bare.endswith("small operations: torch")
    # with attention's 5 M products a row at 50 G a second: 16 rows 8 + 1.6 ms busy; one row still the streaming
    both = limits_line("fast", "bf16p", rounds, 100_000_000, 50_000_000, 1e11, "native", 5_000_000, 5e10)
    assert "and attention's 0.08 G fp32 multiply-adds at 256 positions at 50 G a second" in both
    assert "against 1.92 were both passes at their floors here (one row: 5.0 ms" in both and "9.6 ms; t(16)" in both


def test_attention_products_count_every_head_s_scores_and_values():
    from tr_core.speed.calibrate import attention_products
    model = tiny_model("llama")
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    assert attention_products(model, 100) == c.num_hidden_layers * c.num_attention_heads * 100 * 2 * head_dim


def test_the_limits_line_sets_each_step_against_the_bandwidth_of_its_own_round():
    """A round whose memory ran twice as fast (and its steps with it) does not make the others' steps look faster
    than their streaming: each round's step is divided by its own round's streaming time, then the median taken."""
    from tr_core.speed.calibrate import limits_line
    rounds = [(20.0, 10.0, 25.0), (40.0, 5.0, 12.5), (20.0, 10.0, 25.0), (40.0, 5.0, 12.5), (40.0, 5.0, 12.5)]
    line = limits_line("fast", "bf16p", rounds, 100_000_000, 50_000_000, None, "native")
    # streams 5.0 and 2.5 ms: every round's step at 2.0x; the medians alone (5.0 ms against 2.5) would say 2.0 too,
    # but one bandwidth for all (40 GB/s, the last read) would put the 10 ms rounds at 4.0x
    assert "plain step 5.0 ms" in line and "stream in 2.5 ms at 40.0 GB/s (read in the same rounds: 20.0-40.0)" in line
    assert "2.0x its streaming time (2.0-2.0 round by round)" in line
    uneven = [(20.0, 10.0, 25.0), (40.0, 10.0, 25.0), (30.0, 10.0, 25.0)]
    assert "(2.0-4.0 round by round)" in limits_line("fast", "bf16p", uneven, 100_000_000, 1, None, "native")


def test_paired_limits_reads_the_memory_then_times_the_steps_round_by_round(monkeypatch):
    from tr_core.speed import calibrate
    log = []

    class Bench:
        def __init__(self, model, sizes, *_):
            assert tuple(sizes) == (1, 16)

        def time_round(self, block):
            log.append("steps")
            return {1: [4.0] * block, 16: [9.0] * block}

    monkeypatch.setattr(calibrate, "StepBench", Bench)
    speeds = iter([30.0, 31.0, 32.0])

    def bandwidth():
        log.append("read")
        return next(speeds)

    rounds = calibrate.paired_limits(object(), rounds=3, bandwidth=bandwidth)
    assert log == ["steps", "read", "steps", "read", "steps", "read", "steps"]  # a warm-up round, uncounted
    assert rounds == [(30.0, 4.0, 9.0), (31.0, 4.0, 9.0), (32.0, 4.0, 9.0)]


def test_attention_pairs_alternate_the_two_settings_round_by_round_and_leave_the_tiles_on(monkeypatch):
    """``calibrate --attention``'s pairs on stubbed steps (the tiles' steps 0.8x fp32's at 16 rows): each round runs
    both settings, in turned order, the first round uncounted; the ratio is the rounds' median; the tiles are on
    after, also where a round fails."""
    from tr_core.speed import calibrate, stepbench
    state, log = {"on": True}, []

    class Bench:
        def __init__(self, model, sizes, *_):
            assert tuple(sizes) == calibrate.ATTENTION_SIZES

        def time_round(self, block):
            log.append(state["on"])
            if state.get("fail"):
                raise RuntimeError("a failed step")
            cut = 0.8 if state["on"] else 1.0
            return {n: [10.0 * n * (cut if n == 16 else 1.0)] * block for n in calibrate.ATTENTION_SIZES}

    monkeypatch.setattr(stepbench, "StepBench", Bench)

    def switch(on):
        state["on"] = on

    pairs = calibrate.attention_pairs(object(), 256, rounds=3, switch=switch)
    assert log == [False, True, True, False, False, True, True, False]
    assert pairs[16] == (128.0, 160.0, 0.8) and pairs[1] == (10.0, 10.0, 1.0)
    assert state["on"]
    state["fail"] = True
    with pytest.raises(RuntimeError):
        calibrate.attention_pairs(object(), 256, rounds=3, switch=lambda on: state.update(on=on))
    assert state["on"]


def test_the_peak_is_measured_where_the_library_has_the_instruction(monkeypatch):
    from tr_core.speed import native
    if native.library() is None or "tr_peak_products" not in native._OPTIONAL_HERE:
        assert native.peak_products("fma") is None
        return
    fma = native.peak_products("fma", threads=1, repeats=1)
    assert fma is not None and 0 < fma < float("inf")
    dot = native.peak_products("bf16dot", threads=1, repeats=1)
    # built where the CPU has bf16 dot products (as the bf16 linear layer), else refused at once (no endless search
    # for a long enough call of nothing)
    assert (dot is not None and 0 < dot < float("inf")) == ("tr_linear_bf16" in native._OPTIONAL_HERE)
    monkeypatch.setattr(native, "library", lambda: None)
    assert native.peak_products("fma") is None
