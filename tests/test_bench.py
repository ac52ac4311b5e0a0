"""The benchmark command end to end on a tiny model and a small question file, then its charts (benchmark.py)."""

import json

import pytest

import benchmark
from tr_core import bench
from tr_core.bench import main, question_contexts


def test_bench_writes_tables_and_results(tiny_folder, tmp_path, capsys):
    folder, _, _ = tiny_folder
    questions = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "category": cat, "turns": [f"Question {i} about {cat}: repeat {cat} {cat} {cat}."]}
            for i, cat in enumerate(["qa", "qa", "translation", "writing"])]
    questions.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "out"
    assert main(["--model", str(folder), "--questions", str(questions), "--per-category", "2",
                 "--max-new-tokens", "12", "--methods", "pld,tr,tr-paper,tr-cold", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert set(results["methods"]) == {"plain", "pld", "tr", "tr-paper", "tr-cold"}
    for name, m in results["methods"].items():
        assert {"tokens_per_s", "speedup", "mean_accepted_tokens", "identical", "questions", "by_category"} <= set(m)
        assert m["questions"] == 4 and set(m["by_category"]) == {"qa", "translation", "mt_bench"}
        assert m["identical"] == 4  # float32 tiny model: every output equals plain's here
    assert results["methods"]["plain"]["speedup"] == 1.0
    assert results["methods"]["plain"]["mean_accepted_tokens"] == 1.0
    assert results["config"]["hot_start_carried_across_questions"] is True
    assert "## overall" in printed and "| tr-paper |" in printed
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "results.json"]  # tr_core draws nothing
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
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "results.json", "speedup.html", "tree_size.html"]
    speedup, tree_size = (out / "speedup.html").read_text(), (out / "tree_size.html").read_text()
    assert '"tr-paper"' in speedup and "tr-cold" in speedup
    assert "tr-paper (measured)" in tree_size and "plotly" in tree_size


def test_benchmark_py_runs_the_benchmark_with_the_same_options_then_draws(tmp_path, monkeypatch):
    calls = []

    def fake_bench(argv):
        calls.append(argv)
        out = tmp_path / "out"
        out.mkdir()
        (out / "results.json").write_text(json.dumps({"config": {"fitted_tree": None}, "methods": {
            "plain": {"tokens_per_s": 10.0, "speedup": 1.0, "mean_accepted_tokens": 1.0, "identical": 2,
                      "questions": 2, "by_category": {}}}}))
        return 0

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
    assert "MAT 2.30" in markers[1].text[0]
    # with the steps' own time per token, one more trace: each tree's steps against plain's
    bench["methods"]["plain"]["step_ms_per_token"] = 60.0
    bench["methods"]["tr"]["step_ms_per_token"] = 40.0
    bench["methods"]["tr-paper"]["step_ms_per_token"] = 100.0
    line, steps, *markers = tree_size_figure(bench).data
    assert steps.name.startswith("steps only") and list(steps.x) == [4, 81] and list(steps.y) == [1.5, 0.6]
    assert len(markers) == 2
