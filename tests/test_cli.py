"""The command line, end to end in a subprocess, on a tiny random model saved as a local folder."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, reference_greedy

from tr_core.__main__ import main


def cli(*args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "tr_core", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)


@pytest.mark.slow
def test_json_output_for_every_method(tiny_folder, tmp_path):
    folder, model, tokenizer = tiny_folder
    prompt = "Name three colours."
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_dict=True)["input_ids"]
    outputs = {}
    for method in ("plain", "pld", "tr"):
        trace = tmp_path / f"{method}.json"
        proc = cli("--method", method, "--prompt", prompt, "--model", str(folder), "--max-new-tokens", "20",
                   "--tree", "small", "--top-k", "4", "--json", "--trace", str(trace))
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert {"text", "token_ids", "steps", "mean_accepted_tokens", "tokens_per_s"} <= set(out)
        recorded = json.loads(trace.read_text())
        assert len(recorded["events"]) == out["steps"] and recorded["meta"]["tokens"] == len(out["token_ids"])
        assert (recorded["meta"]["device"], recorded["meta"]["backend"]) == ("cpu", "native")  # --device auto here
        if method != "plain":  # plain decoding measured beside the run, to the same length, on the same machine
            assert recorded["meta"]["identical_to_plain"] is True and recorded["meta"]["plain_tokens_per_s"] > 0
        outputs[method] = out["token_ids"]
    want = reference_greedy(model, list(ids), 20)
    eos = tokenizer.eos_token_id
    if eos in want:
        want = want[: want.index(eos) + 1]
    assert outputs["plain"] == outputs["pld"] == outputs["tr"] == want


def test_text_output_reports_the_figures(tiny_folder):
    folder, _, _ = tiny_folder
    proc = cli("--prompt", "Hi", "--model", str(folder), "--max-new-tokens", "8", "--tree", "tiny")
    assert proc.returncode == 0, proc.stderr
    assert "mean accepted tokens" in proc.stderr and "tokens/s" in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--model", "no-such-org/no-such-model"], "could not load model id 'no-such-org/no-such-model'"),
    (["--model", "/nonexistent/folder"], "could not load"),
    (["--tree", "no-such-tree"], "unknown tree template"),
    (["--tree", "paper", "--top-k", "4"], "needs top_k >= 8"),  # the paper tree uses ranks up to 7
    (["--max-new-tokens", "0"], "max_new_tokens must be at least 1"),
    (["--device", "quantum"], "unknown device 'quantum'"),
])
def test_bad_input_gives_one_clear_error(tiny_folder, args, message, capsys):
    folder, _, _ = tiny_folder
    base = ["--prompt", "Hi"] + ([] if "--model" in args else ["--model", str(folder)])
    assert main(base + args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1  # one line, no traceback


def test_auto_tree_falls_back_for_a_model_without_acceptance_statistics(tiny_folder, capsys):
    folder, _, _ = tiny_folder
    assert main(["--prompt", "Hi", "--model", str(folder), "--max-new-tokens", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tree"] == "small" and out["hot_start"] is None


def test_every_method_the_readme_lists_runs_from_the_command_line(tiny_folder, capsys):
    # issue 54: the methods are named once (tr_core/methods.py); the README's table and the CLI read the same names
    import re

    from tr_core.methods import METHODS

    table = (ROOT / "README.md").read_text().split("## Methods", 1)[1].split("\n\n", 2)[1]
    listed = [name for cell in re.findall(r"^\| (`[^|]+`) \|", table, re.M) for name in re.findall(r"`([^`]+)`", cell)]
    assert "tr-paper" in listed and set(listed) <= set(METHODS), listed
    folder, _, _ = tiny_folder
    outputs = {}
    for method in listed:
        assert main(["--method", method, "--prompt", "Name three colours.", "--model", str(folder),
                     "--max-new-tokens", "8", "--tree", "small", "--json"]) == 0, method
        outputs[method] = json.loads(capsys.readouterr().out)["token_ids"]
    assert all(ids == outputs["plain"] for ids in outputs.values()), outputs
