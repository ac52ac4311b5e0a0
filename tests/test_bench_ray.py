"""The benchmark in shards: on a local Ray with two workers it gives the single-process run's tokens, identical flags
and tokens per pass; a worker killed mid-question loses no question; a run interrupted and resumed ends as one that
was not (timings aside). And the run folder's own rules, without Ray."""

import json
import os
import pickle
import signal

import pytest

from tr_core.tools import bench, run_folder
from tr_core.tools.bench import EXIT_ONCE, main
from tr_core.tools.run_folder import RunFolder, plan_shards

ROWS = [(0, "qa"), (1, "qa"), (2, "translation"), (3, "writing"), (4, "translation"), (5, "writing")]
# methods whose drafts do not depend on timings (plain, Prompt Lookup, the paper's fixed tree), so that two runs
# must agree on every step, not only on the tokens
METHODS = "pld,tr-paper"


@pytest.fixture(scope="module")
def setting(tiny_folder, tmp_path_factory):
    folder, _, _ = tiny_folder
    questions = tmp_path_factory.mktemp("questions") / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [
        f"Question {i} about {c}: repeat {c} {c} {c}, then say why."]}) for i, c in ROWS))
    return ["--model", str(folder), "--questions", str(questions), "--per-category", "2", "--max-new-tokens", "10",
            "--rounds", "2", "--methods", METHODS]


def outcome(out) -> dict:
    """What a run decoded, timings aside: per (temperature, question), plain's tokens and each method's record."""
    lines = RunFolder(out).done()
    keep = ("tokens", "steps", "identical", "accepted_lengths", "draft_nodes", "first_difference")
    return {(line["temperature_index"], line["question_id"]): {
        "plain": line["plain_token_ids"], "shard": (line["shard"], line["position"]),
        **{name: {k: r[k] for k in keep} for name, r in line["records"].items()}}
        for unit in lines.values() for line in unit}


def keys(tree, prefix=""):
    """Every key path of a results.json, lists of records left out."""
    if isinstance(tree, dict):
        return {p for k, v in tree.items() for p in {f"{prefix}/{k}"} | keys(v, f"{prefix}/{k}")}
    return set()


@pytest.fixture(scope="module")
def single(setting, tmp_path_factory):
    """The reference: one process, one thread, the same two shards a two-worker run draws."""
    out = tmp_path_factory.mktemp("single") / "out"
    assert main(setting + ["--shards", "2", "--threads", "1", "--out", str(out)]) == 0
    return out


@pytest.mark.slow
def test_two_ray_workers_decode_as_one_process_does(setting, single, tmp_path, capsys):
    out = tmp_path / "ray"
    assert main(setting + ["--ray", "--workers", "2", "--shards", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    ray_run, one = outcome(out), outcome(single)
    assert len(one) == 6 and ray_run == one  # same shards, tokens, identical flags, tokens per pass, drafts
    assert all(r["identical"] for q in one.values() for name, r in q.items() if name not in ("plain", "shard"))
    results, reference = (json.loads((p / "results.json").read_text()) for p in (out, single))
    assert keys(results) - {"/config/workers"} >= keys(reference) - {"/config/workers"}  # results.json keeps its keys
    for name in ("plain", "pld", "tr-paper"):
        for key in ("mean_accepted_tokens", "identical", "mean_draft_nodes"):
            assert results["methods"][name][key] == reference["methods"][name][key]
    # each question's machine, and the workers: two, each with its share of the questions
    workers = results["config"]["workers"]
    assert sorted(w["worker"] for w in workers) == ["w0", "w1"] and sum(w["questions"] for w in workers) == 6
    assert {q["machine"] for q in results["config"]["question_machines"]} == {workers[0]["machine"]}
    assert len({q["worker_id"] for q in results["config"]["question_machines"]}) == 2
    report = (out / "report.md").read_text()
    assert f"- w0 on {workers[0]['host']}: {workers[0]['machine']}, 1 thread(s), 3 question(s)" in report
    assert "Shards: 2, drawn stratified by category" in report and "on 2 worker(s) in Ray (local)" in printed


@pytest.mark.slow
def test_a_worker_killed_mid_question_loses_no_question(setting, single, tmp_path, monkeypatch):
    marker = tmp_path / "killed"
    monkeypatch.setenv(EXIT_ONCE, f"{marker}:2")  # question 2: the second of shard 0, after its first decoding
    out = tmp_path / "ray"
    assert main(setting + ["--ray", "--workers", "2", "--shards", "2", "--out", str(out)]) == 0
    assert marker.is_file()  # a worker did end its process in the middle of question 2
    assert outcome(out) == outcome(single)  # every question there once, decoded as without the kill
    assert len({(line["temperature_index"], line["question_id"]) for line in RunFolder(out).lines()}) == 6


@pytest.mark.slow
def test_a_run_interrupted_then_resumed_ends_as_an_uninterrupted_run(setting, single, tmp_path, monkeypatch,
                                                                      capsys):
    out = tmp_path / "run"
    saved = run_folder.RunFolder.save_state
    calls = []

    def stop_on_the_third(self, *a):
        calls.append(a)
        if len(calls) == 3:  # its line is written, its state not: the question is decoded again on resume
            os.kill(os.getpid(), signal.SIGTERM)  # `kill`: the run stops as on Ctrl-C
        saved(self, *a)

    monkeypatch.setattr(run_folder.RunFolder, "save_state", stop_on_the_third)
    assert main(setting + ["--shards", "2", "--threads", "1", "--out", str(out)]) == 130
    assert f"go on with: python -m tr_core.tools.bench --resume {out}\n" in capsys.readouterr().out  # no --ray
    assert len(RunFolder(out).lines()) == 3 and sum(map(len, RunFolder(out).done().values())) == 2
    assert not (out / "results.json").exists()
    monkeypatch.setattr(run_folder.RunFolder, "save_state", saved)
    # the tables of what is finished, without decoding anything
    assert main(["--resume", str(out), "--report-so-far"]) == 0
    assert "So far: 2 of the run's 6 questions are finished" in (out / "report_so_far.md").read_text()
    assert json.loads((out / "results_so_far.json").read_text())["methods"]["plain"]["questions"] == 2
    assert len(RunFolder(out).lines()) == 3 and not (out / "results.json").exists()
    # a new run into the unfinished run's folder would lose it: refused
    with pytest.raises(SystemExit):
        main(setting + ["--out", str(out)])
    assert "holds an unfinished run (3 question(s) done): go on with --resume" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --resume goes on with the run's own options
        main(["--resume", str(out), "--max-new-tokens", "20"])
    assert "--max-new-tokens 20 (the run's: 10)" in capsys.readouterr().err
    assert main(["--resume", str(out), "--ray", "--workers", "2"]) == 0
    assert outcome(out) == outcome(single)
    resumed, reference = (json.loads((p / "results.json").read_text()) for p in (out, single))
    for name, m in reference["methods"].items():
        for key in ("mean_accepted_tokens", "identical", "questions", "accepted_length_histogram", "mean_draft_nodes"):
            assert resumed["methods"][name][key] == m[key]
    assert len(resumed["config"]["sessions"]) == 2 and resumed["config"]["shards"] == reference["config"]["shards"]


# --- the run folder, without Ray or a model ------------------------------------------------------------------------

def test_shards_are_stratified_by_category_and_keep_the_run_order():
    questions = [(i, c) for i, c in enumerate(["qa", "math", "rag"] * 4)]  # as stratified() orders them
    shards = plan_shards(questions, 2)
    assert sorted(sum(shards, [])) == list(range(12)) and [len(s) for s in shards] == [6, 6]
    for shard in shards:
        assert shard == sorted(shard)  # the run's order within a shard
        assert sorted(questions[i][1] for i in shard) == ["math", "math", "qa", "qa", "rag", "rag"]
    assert sorted(plan_shards(questions, 50)) == [[i] for i in range(12)]  # no empty shard


def test_a_line_past_its_units_state_is_decoded_again_and_the_later_line_wins(tmp_path):
    folder = RunFolder(tmp_path / "run")
    folder.start({"questions": [7, 8], "temperatures": [None], "shards": [[7, 8]]})
    folder.append({"temperature_index": 0, "shard": 0, "position": 0, "question_id": 7, "v": "first"})
    folder.save_state(0, 0, 1, pickle.dumps("after 7"))
    folder.append({"temperature_index": 0, "shard": 0, "position": 1, "question_id": 8, "v": "died before its state"})
    assert [line["v"] for line in folder.done()[0, 0]] == ["first"] and folder.missing_any()
    assert folder.state(0, 0) == (1, pickle.dumps("after 7"))
    with open(folder.path / "questions.jsonl", "a") as f:
        f.write('{"temperature_index": 0, "sha')  # a line cut short by a crash
    folder.append({"temperature_index": 0, "shard": 0, "position": 1, "question_id": 8, "v": "again"})
    folder.save_state(0, 0, 2, b"")
    assert [line["v"] for line in folder.done()[0, 0]] == ["first", "again"] and not folder.missing_any()


def test_resume_of_a_folder_without_a_run_says_so(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--resume", str(tmp_path)])
    assert "holds no benchmark run (plan.json is missing): nothing to resume" in capsys.readouterr().err


@pytest.mark.slow
def test_questions_from_two_kinds_of_machine_get_a_table_each(setting, single, tmp_path, monkeypatch):
    """A finished run resumed reports again from its folder; where its questions ran on two kinds of machine (shard 1
    relabelled here), every method gets a row per machine, and the overall speedup stays over all questions."""
    import shutil
    out = tmp_path / "two"
    shutil.copytree(single, out)
    lines = (out / "questions.jsonl").read_text().splitlines()
    relabelled = []
    for text in lines:
        line = json.loads(text)
        if line["shard"] == 1:
            line["machine"] = "Another CPU"
        relabelled.append(json.dumps(line))
    (out / "questions.jsonl").write_text("\n".join(relabelled) + "\n")
    from tr_core.tools import bench
    monkeypatch.setattr(bench, "LocalPool", lambda *a, **k: pytest.fail("a finished run starts no worker"))
    assert main(["--resume", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    machines = results["config"]["machines"]
    assert len(machines) == 2 and "Another CPU" in machines
    for m in results["methods"].values():
        assert set(m["by_machine"]) == set(machines) and m["questions"] == 6
        assert sum(v["questions"] for v in m["by_machine"].values()) == 6
    assert "## overall, on Another CPU alone" in (out / "report.md").read_text()
    assert outcome(out) == outcome(single)  # resuming a finished run decodes nothing again


def test_the_shards_follow_the_questions_alone_not_the_workers():
    # issue 54, item 8: a run's results depend on its shards (each carries its own matrix), so without --shards
    # they are fixed by the questions: a one-process run and a run on any number of workers deal them alike
    from tr_core.tools.bench import SHARD_QUESTIONS, shard_count

    assert "workers" not in shard_count.__code__.co_varnames
    assert [shard_count(None, n) for n in (4, 12, SHARD_QUESTIONS, SHARD_QUESTIONS + 1, 480)] == [1, 1, 1, 2, 20]
    assert shard_count(5, 12) == 5
