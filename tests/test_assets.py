"""The shipped assets: small, loadable, consistent, and built from prompts that are not benchmark questions."""

import json

from conftest import ROOT
from safetensors import safe_open

from tr_core.assets import ASSETS_DIR, acceptance_path, hot_start_files, hot_start_path
from tr_core.matrix import AdjacencyMatrix
from tr_core.spec_bench import load_questions
from tr_core.tools.build_assets import generic_prompts
from tr_core.tree import load_template


def test_the_assets_folder_is_the_repositorys():
    assert ASSETS_DIR == ROOT / "assets" and ASSETS_DIR.is_dir()


def test_hot_start_files_put_the_asked_k_first(tmp_path):
    for name in ("m-k4", "m-k8", "m-k16", "other-k8"):
        (tmp_path / f"{name}.safetensors").touch()
    assert [p.stem for p in hot_start_files("m", 8, tmp_path)] == ["m-k8", "m-k16", "m-k4"]  # then by name
    assert [p.stem for p in hot_start_files("m", 2, tmp_path)] == ["m-k16", "m-k4", "m-k8"]
    assert hot_start_files("m", 8, tmp_path / "missing") == []


def test_hot_start_matrix_is_small_and_loads():
    path = hot_start_path("smollm2-135m-instruct", 8)
    assert path.stat().st_size < 3 * 1024 * 1024  # the ids (the paper's M, 1.5 MB) and their fp16 probabilities
    m = AdjacencyMatrix.load(path, vocab_size=49_152, k=8)
    assert m.rows.numel() * m.rows.element_size() < 2 * 1024 * 1024  # the paper's M stays under 2 MB
    assert int((m.rows != 0).any(dim=1).sum()) > 1000  # thousands of rows learned
    assert m.probs is not None and bool((m.probs[m.rows[:, 0] != 0, 0] > 0).all())  # each learned row's p
    with safe_open(str(path), "pt") as f:
        # the builder's command, under its name when this matrix was built (it moved to tr_core.tools since)
        assert f.metadata()["built_by"] in ("python -m tr_core.tools.build_assets", "python -m tr_core.build_assets")


def test_acceptance_statistics_are_consistent_with_the_paper_tree():
    stats = json.loads(acceptance_path("smollm2-135m-instruct").read_text())
    paper = load_template("paper")
    assert [tuple(p) for p in stats["node_paths"]] == list(paper.node_paths)
    acc = stats["acceptance"]
    assert acc[0] == 1.0
    for i in range(1, paper.size):
        assert 0 <= acc[i] <= acc[int(paper.parents[i])]
    # the expected accepted length equals the measured mean accepted tokens of those steps
    assert abs(sum(acc) - stats["mean_accepted_tokens"]) < 0.05


def test_generic_prompts_are_not_spec_bench_questions():
    prompts = generic_prompts()
    assert len(prompts) >= 30
    questions = {q.prompt.strip().lower() for q in load_questions()}
    assert not any(p.strip().lower() in questions for p in prompts)


def test_the_readme_fits_a_newcomers_screen_and_keeps_its_two_commands():
    """Issue 46: under 200 lines, the two set-up commands in it (the measurement history lives in docs/)."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 200
    assert "bash scripts/app.sh" in text and "bash scripts/test.sh" in text
