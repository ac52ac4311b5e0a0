"""The benchmark command end to end on a tiny model and a small question file, then its charts (benchmark.py)."""

import copy
import json

import pytest

import benchmark
from tr_core.decoding import DecodeResult
from tr_core.stats import bootstrap_median_interval, compare, median_round, verdict
from tr_core.tools import bench
from tr_core.tools.bench import MethodRunner, main, measure_question, question_contexts, round_orders
from tr_core.tools.report import prediction_table
from tr_core.tools.results import Record, pairwise, predicted_vs_measured, speedup_on

# The keys of results.json as the benchmark wrote them before it measured in rounds (a run of that code on the tiny
# model of test_bench_writes_tables_and_results): every one must stay, with its meaning.
OLD_TOP_KEYS = {"config", "methods"}
OLD_CONFIG_KEYS = {"compiled", "dtype", "fit_context", "fitted_tree", "hot_start", "hot_start_carried_across_questions",
                   "load_average_after", "load_average_before", "max_new_tokens", "mode", "mode_note", "model",
                   "per_category", "questions", "seconds", "t_n_ms", "threads"}
OLD_CATEGORY_KEYS = {"forward_ms_per_step", "identical", "mean_accepted_tokens", "outside_steps_s_per_question",
                     "overhead_ms_per_step", "questions", "speedup", "step_ms_per_token", "tokens_per_s"}
OLD_METHOD_KEYS = OLD_CATEGORY_KEYS | {"accepted_length_histogram", "by_category", "first_differences"}
NEW_KEYS = {"speedup_median", "speedup_ci95", "verdict"}  # overall and in each category
RUN_FILES = ["log.jsonl", "plan.json", "questions.jsonl", "report.md", "results.json", "state"]


def test_bench_writes_tables_and_results(tiny_folder, tmp_path, capsys):
    folder, _, _ = tiny_folder
    questions = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "category": cat, "turns": [f"Question {i} about {cat}: repeat {cat} {cat} {cat}."]}
            for i, cat in enumerate(["qa", "qa", "translation", "writing"])]
    questions.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "out"
    assert main(["--model", str(folder), "--questions", str(questions), "--per-category", "2",
                 "--max-new-tokens", "12", "--rounds", "2", "--methods", "pld,tr,tr-paper,tr-cold",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert set(results["methods"]) == {"plain", "pld", "tr", "tr-paper", "tr-cold"}
    for name, m in results["methods"].items():
        assert {"tokens_per_s", "speedup", "mean_accepted_tokens", "identical", "questions", "by_category"} <= set(m)
        assert m["questions"] == 4 and set(m["by_category"]) == {"qa", "translation", "mt_bench"}
        assert m["identical"] == 4  # float32 tiny model: every output equals plain's here
    assert results["methods"]["plain"]["speedup"] == 1.0
    # the keys results.json had before the rounds are all there still, with the new ones beside them
    assert OLD_TOP_KEYS <= set(results) and OLD_CONFIG_KEYS <= set(results["config"])
    for m in results["methods"].values():
        assert OLD_METHOD_KEYS | NEW_KEYS <= set(m)
        assert all(OLD_CATEGORY_KEYS | NEW_KEYS <= set(c) for c in m["by_category"].values())
        lo, hi = m["speedup_ci95"]
        assert lo <= m["speedup_median"] <= hi and m["verdict"] == "too few questions"  # 4 questions: no verdict
    assert results["methods"]["plain"]["speedup_median"] == 1.0
    assert results["config"]["rounds"] == 2 and results["config"]["bootstrap"]["resamples"] == 2000
    assert [(p["method"], p["against"]) for p in results["pairwise"]] == [
        ("tr", "pld"), ("tr-paper", "pld"), ("tr-cold", "pld"), ("tr-paper", "tr"), ("tr-cold", "tr"),
        ("tr-cold", "tr-paper")]
    assert "| tr-paper | tr | " in printed and "speedup: median [95% interval]" in printed
    assert results["methods"]["plain"]["mean_accepted_tokens"] == 1.0
    assert results["config"]["hot_start_carried_across_questions"] is True
    assert "## overall" in printed and "| tr-paper |" in printed
    # the run's folder: its plan, a line per question, the shards' state, the log; tr_core draws nothing
    assert sorted(p.name for p in out.iterdir()) == RUN_FILES
    assert results["methods"]["tr-paper"]["tree_nodes"] == 81 and results["config"]["compiled"] is False
    # where the time went: steps per token, and the time each question spent outside its steps (its prefill)
    for m in results["methods"].values():
        assert m["step_ms_per_token"] > 0 and m["outside_steps_s_per_question"] > 0
    assert "## where the time went" in printed
    # the auto tree was fitted on t(N) averaged over the questions' contexts (each prompt plus half the answer)
    assert results["config"]["fit_context"].startswith("4 contexts of ")
    assert "t(N) ms over 4 contexts of" in printed
    # the charts come from results.json, drawn by visualize through benchmark.py
    assert benchmark.main(["--charts-only", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(RUN_FILES + ["speedup.html", "tree_size.html"])
    speedup, tree_size = (out / "speedup.html").read_text(), (out / "tree_size.html").read_text()
    assert '"tr-paper"' in speedup and "tr-cold" in speedup
    assert "tr-paper (measured)" in tree_size and "plotly" in tree_size


def write_fake_results(out) -> int:
    """What a benchmark run leaves for the charts: a results.json of plain decoding alone."""
    out.mkdir()
    (out / "results.json").write_text(json.dumps({"config": {"fitted_tree": None}, "methods": {
        "plain": {"tokens_per_s": 10.0, "speedup": 1.0, "mean_accepted_tokens": 1.0, "identical": 2,
                  "questions": 2, "by_category": {}}}}))
    return 0


def test_benchmark_py_runs_the_benchmark_with_the_same_options_then_draws(tmp_path, monkeypatch):
    calls = []

    def fake_bench(argv):
        calls.append(argv)
        return write_fake_results(tmp_path / "out")

    monkeypatch.setattr(bench, "main", fake_bench)
    argv = ["--per-category", "1", "--methods", "pld", "--out", str(tmp_path / "out")]
    assert benchmark.main(argv) == 0
    assert calls == [argv]
    assert (tmp_path / "out" / "speedup.html").is_file() and (tmp_path / "out" / "tree_size.html").is_file()


@pytest.mark.parametrize("argv, message", [
    (["--charts-only", "--mode", "fast"], "takes --out only"),
    (["--charts-only", "--out", "no-such-folder"], "run the benchmark first"),
])
def test_charts_only_measures_nothing(argv, message, capsys):
    with pytest.raises(SystemExit):
        benchmark.main(argv)
    assert message in capsys.readouterr().err


def test_each_question_decodes_over_its_prompt_and_half_its_answer():
    assert question_contexts([100, 300], 128) == (164, 364)


def test_tree_size_figure_draws_the_prediction_and_each_measured_tree():
    from visualize import tree_size_figure
    table = [{"nodes": n, "expected_accepted": 1 + 0.1 * n, "step_ms": 50 + 5 * n, "predicted_speedup": s}
             for n, s in [(1, 1.0), (2, 1.2), (4, 1.3), (8, 0.9)]]
    bench = {"config": {"fitted_tree": {"table": table}}, "methods": {
        "plain": {"speedup": 1.0, "mean_accepted_tokens": 1.0},
        "tr": {"speedup": 1.25, "mean_accepted_tokens": 1.45, "tree_nodes": 4},
        "tr-paper": {"speedup": 0.5, "mean_accepted_tokens": 2.3, "tree_nodes": 81}}}
    fig = tree_size_figure(bench)
    line, *markers = fig.data
    assert list(line.x) == [1, 2, 4, 8] and list(line.y) == [1.0, 1.2, 1.3, 0.9]
    assert [(m.name, list(m.x), list(m.y)) for m in markers] == [("tr (measured)", [4], [1.25]),
                                                                  ("tr-paper (measured)", [81], [0.5])]
    assert "2.30 tokens per forward pass" in markers[1].text[0]
    # with the steps' own time per token, one more trace: each tree's steps against plain's
    bench["methods"]["plain"]["step_ms_per_token"] = 60.0
    bench["methods"]["tr"]["step_ms_per_token"] = 40.0
    bench["methods"]["tr-paper"]["step_ms_per_token"] = 100.0
    line, steps, *markers = tree_size_figure(bench).data
    assert steps.name.startswith("steps only") and list(steps.x) == [4, 81] and list(steps.y) == [1.5, 0.6]
    assert len(markers) == 2


# --- rounds -------------------------------------------------------------------------------------------------------

def test_each_round_runs_every_method_once_and_the_order_rotates_between_rounds():
    names = ["plain", "pld", "tr", "tr-4"]
    orders = [order for q in range(3) for order in round_orders(names, 3, q)]
    assert len(orders) == 9 and all(sorted(order) == sorted(names) for order in orders)
    for before, after in zip(orders, orders[1:]):  # one place on, within a question and across questions
        assert after == before[1:] + before[:1]
    # over as many rounds as there are methods, each method runs once in every place
    assert all(sorted(order[place] for order in orders[:4]) == sorted(names) for place in range(4))
    assert round_orders(names, 1, 0) == [names]


class StubMatrix:
    """What a run teaches a matrix, as the list of runs that taught it."""

    def __init__(self, taught=()):
        self.taught = list(taught)

    def clone(self):
        return StubMatrix(self.taught)


class StubEngine:
    """An engine without a model: each run logs which method ran from what matrix; a Token Recycling run then
    teaches that matrix."""

    def __init__(self, name, log, matrix):
        self.name, self.log, self.matrix = name, log, matrix

    def with_matrix(self, matrix):
        engine = copy.copy(self)
        engine.matrix = matrix
        return engine

    def fresh_matrix(self):
        return StubMatrix()

    def generate(self, ids, max_new_tokens, method):
        self.log.append((self.name, tuple(self.matrix.taught)))
        if method == "tr":
            self.matrix.taught.append(f"{self.name} run {len(self.log)}")
        return DecodeResult(list(ids), "", 1, 0.1 * len(self.log), "max_new_tokens")


def stub_runners(log):
    return [MethodRunner("plain", StubEngine("plain", log, StubMatrix()), "plain"),
            MethodRunner("tr", StubEngine("tr", log, StubMatrix(["hot start"])), "tr"),
            MethodRunner("tr-cold", StubEngine("tr-cold", log, StubMatrix()), "tr", reset_each_question=True)]


def test_a_question_decodes_with_the_garbage_collector_paused_and_it_runs_again_after():
    """A full collection scans every object the benchmark holds; inside a timed question it would be billed to
    whichever method ran it, so every run decodes with the collector paused (as timeit times)."""
    import gc

    states = []

    class Recording(StubEngine):
        def generate(self, ids, max_new_tokens, method):
            states.append(gc.isenabled())
            return super().generate(ids, max_new_tokens, method)
    runners = [MethodRunner(name, Recording(name, [], StubMatrix()), "tr") for name in ("plain", "tr")]
    measure_question(runners, [5, 6], 8, 2, 0)
    assert states == [False] * 4 and gc.isenabled()


def test_rounds_run_in_the_scheduled_order_and_every_round_starts_from_the_same_matrix():
    log, ran = [], []
    runners = stub_runners(log)
    results = measure_question(runners, [5, 6], 8, 3, 0, on_run=lambda: ran.append(len(log)))
    assert [name for name, _ in log] == [n for order in round_orders(["plain", "tr", "tr-cold"], 3, 0) for n in order]
    assert ran == list(range(1, 10)) and {n: len(r) for n, r in results.items()} == {"plain": 3, "tr": 3, "tr-cold": 3}
    # every round of tr drafted from the matrix held before the question, not from what an earlier round taught
    assert [m for name, m in log if name == "tr"] == [("hot start",)] * 3
    assert [m for name, m in log if name == "tr-cold"] == [()] * 3  # a cold runner: empty every round
    # after the question tr keeps what its first round taught (one round's learning, carried to the next question)
    first_tr = next(i for i, (name, _) in enumerate(log) if name == "tr") + 1
    assert runners[1].engine.matrix.taught == ["hot start", f"tr run {first_tr}"]
    assert runners[2].engine.matrix.taught == []  # a cold runner's own matrix is never taught
    # the next question's rounds all start from that matrix
    measure_question(runners, [7], 8, 2, 1)
    assert [m for name, m in log[9:] if name == "tr"] == [("hot start", f"tr run {first_tr}")] * 2


def test_a_question_is_timed_by_its_median_round():
    def res(seconds):
        return DecodeResult([1], "", 1, seconds, None)

    def median(rounds):
        return median_round(rounds, seconds=lambda r: r.elapsed_s)

    assert median([res(3.0), res(1.0), res(2.0)]).elapsed_s == 2.0
    assert median([res(9.0), res(1.0), res(2.0), res(3.0)]).elapsed_s == 2.0  # even: the faster middle one
    assert median([res(4.0)]).elapsed_s == 4.0


# --- speedups with intervals --------------------------------------------------------------------------------------

CLEAR = [1.31, 1.25, 1.4, 1.35, 1.28, 1.22, 1.3, 1.27, 1.33, 1.29]  # every question faster, by about 30%
NOISY = [0.6, 1.5, 0.9, 1.3, 0.8, 1.6, 1.1, 0.7, 1.2, 0.95]  # as often slower as faster, widely spread


def test_the_bootstrap_interval_excludes_one_only_where_the_ratios_agree():
    lo, hi = bootstrap_median_interval(CLEAR)
    assert 1.0 < lo <= 1.3 <= hi <= 1.4
    lo, hi = bootstrap_median_interval(NOISY)
    assert lo < 1.0 < hi
    lo, hi = bootstrap_median_interval([1 / r for r in CLEAR])
    assert hi < 1.0
    assert bootstrap_median_interval(NOISY) == bootstrap_median_interval(NOISY)  # seeded
    assert compare(CLEAR)["verdict"] == "faster" and compare(NOISY)["verdict"] == "no clear difference"
    assert compare([1 / r for r in CLEAR])["verdict"] == "slower"
    assert compare(CLEAR)["speedup_median"] == 1.295


def test_a_method_is_called_faster_or_slower_only_where_its_interval_excludes_one():
    assert verdict((1.01, 1.5), 30) == "faster"
    assert verdict((0.5, 0.99), 30) == "slower"
    assert verdict((1.0, 1.5), 30) == verdict((0.5, 1.0), 30) == verdict((0.9, 1.1), 30) == "no clear difference"
    assert verdict((1.2, 1.3), bench.MIN_QUESTIONS_FOR_VERDICT - 1) == "too few questions"
    assert verdict(None, 1) == "too few questions"
    assert compare([1.4]) == {"speedup_median": 1.4, "speedup_ci95": None, "verdict": "too few questions"}


def records(method, seconds_by_question, category="qa"):
    return [Record(q, category, method, 10, 5, s, True, [2] * 5, 0.0, 0.0, round_seconds=[s])
            for q, s in enumerate(seconds_by_question)]


def test_pairs_of_methods_compare_per_question_like_each_against_plain():
    recs = {"plain": records("plain", [2.0] * 6), "pld": records("pld", [1.0] * 6),
            "tr": records("tr", [1.0, 0.5, 1.0, 0.5, 1.0, 0.5])}
    (pair,) = pairwise(recs, ["qa"])
    assert (pair["method"], pair["against"], pair["questions"]) == ("tr", "pld", 6)
    assert pair["speedup_median"] == 1.5 and pair["speedup_ci95"] == [1.0, 2.0]  # ratios 1, 2, 1, 2, 1, 2
    assert pair["verdict"] == "no clear difference" and pair["by_category"]["qa"]["speedup_median"] == 1.5


def test_a_fitted_tree_shows_its_prediction_beside_what_was_measured():
    tr = {"tree_nodes": 5, "predicted_mean_accepted_tokens": 1.8, "mean_accepted_tokens": 1.6,
          "predicted_speedup": 1.5, "steps_speedup": 1.25, "tokens_per_s": 20.0, "speedup_median": 1.2,
          "speedup_ci95": [1.1, 1.3], "forward_ms_per_step": 25.0, "overhead_ms_per_step": 1.0}
    plain = {"tokens_per_s": 16.0, "forward_ms_per_step": 19.0, "overhead_ms_per_step": 1.0}
    tr.update(predicted_vs_measured(tr, plain))
    # per step: 1.5x predicted against 1.25x measured; end to end: 1.5 x 16 tokens/s = 24 against 20 measured
    assert tr["predicted_tokens_per_s"] == 24.0 and tr["predicted_tokens_per_s_error_pct"] == 20.0
    assert tr["predicted_steps_error_pct"] == 20.0
    table = prediction_table({"methods": {"plain": plain, "tr": tr}})
    # step cost: predicted 1.8 / 1.5 = 1.2x a plain step; measured (25 + 1) / (19 + 1) = 1.3x
    assert table.splitlines()[2] == ("| tr | 5 | 1.80 | 1.60 | 1.20x | 1.30x | 1.50x | 1.25x | +20% | 24.00 | 20.00 | "
                                     "+20% | 1.20x [1.10, 1.30] | - | - |")
    # t(N) through the run: the same 1.8 expected tokens over a step cost of 1.44x gives 1.25x, as measured
    tr["predicted_speedup_through_run"] = speedup_on(1.5, 5, {1: 20.0, 5: 24.0}, {1: 20.0, 5: 28.8})
    tr.update(predicted_vs_measured(tr, plain))
    assert tr["predicted_through_run_steps_error_pct"] == 0.0
    assert prediction_table({"methods": {"plain": plain, "tr": tr}}).splitlines()[2].endswith("| 1.25x | +0% |")
    assert len(table.splitlines()) == 3  # plain has no fitted tree


def test_benchmark_py_draws_a_resumed_run_in_its_own_folder(tmp_path, monkeypatch):
    run = tmp_path / "run"

    def fake_bench(argv):
        return write_fake_results(run)

    monkeypatch.setattr(bench, "main", fake_bench)
    assert benchmark.main(["--resume", str(run), "--ray"]) == 0
    assert (run / "speedup.html").is_file() and (run / "tree_size.html").is_file()
