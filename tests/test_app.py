"""The app: the HTML a user reads (from hand-made events), the per-user session and the model cache (with fakes and a
tiny model), and the named API endpoints of a launched app on the embedded model, through gradio_client."""

from __future__ import annotations

import copy
import html
import json
import os
import pickle
import re
import socket
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")

from conftest import ROOT  # noqa: E402

import app  # noqa: E402
from tr_core.engine import Engine  # noqa: E402
from tr_core.events import Rates, RowUpdate, StepEvent  # noqa: E402
from tr_core.matrix import AdjacencyMatrix  # noqa: E402
from tr_core.models import EMBEDDED_HUB_ID, ModelLoadError  # noqa: E402
from tr_core.stats import SPEEDUP_DEFINITION, Spread, speedup  # noqa: E402
from tr_core.stats import first_difference as first_different_token  # noqa: E402
from tr_core.tree import BUILTIN_TEMPLATES  # noqa: E402
from ui import models as models_mod  # noqa: E402
from ui.frames import live_frame, race_frame  # noqa: E402
from ui.inputs import InputError  # noqa: E402
from ui.models import ModelCache  # noqa: E402
from ui.records import Baseline, RaceRun, race_summary  # noqa: E402
from ui.render import (  # noqa: E402
    answer_html,
    counters_html,
    history_html,
    lanes_html,
    race_table_html,
    race_verdict,
    split_step,
)
from ui.run import Every, LiveRun, PlainAlongside, Race, draft_note, tree_note  # noqa: E402
from ui.session import Session, starting_matrix  # noqa: E402
from ui.settings import Settings, tree_choices, tree_names  # noqa: E402

PROMPT = "Name three colours."
NEW_TOKENS = 16
# gradio's queue calls a pandas option that pandas 3 deprecates: not ours to fix
pytestmark = [pytest.mark.app, pytest.mark.filterwarnings("ignore:.*(no_silent_downcasting|copy keyword)"),
              pytest.mark.usefixtures("no_outside_network")]  # nothing this process does leaves 127.0.0.1


def hand_event(**changes) -> StepEvent:
    """Root 'a' -> ' b' (node 1) -> '\\n' (node 3) accepted, then the bonus ' e': three tokens in one step."""
    event = dict(step=0, method="tr", tree_name="hand", tree_tokens=[10, 11, 12, 13, 14],
                 tree_parents=[-1, 0, 0, 1, 1], tree_ranks=[0, 0, 1, 0, 1], tree_text=["a", " b", "d", "\n", "c"],
                 predicted=[11, 13, 99, 15, 16], accepted_path=[0, 1, 3], bonus_token=15, new_tokens=[11, 13, 15],
                 new_text=" b\n e", rows_updated=[RowUpdate(10, [11, 12], [11, 40])], total_tokens=3, total_steps=1,
                 elapsed_s=0.5)
    event.update(changes)
    return StepEvent(**event)


def single_event(step: int, token: int, text: str, total: int, elapsed: float) -> StepEvent:
    """A step that accepted no draft: only its bonus token."""
    return hand_event(step=step, accepted_path=[0], bonus_token=token, new_tokens=[token], new_text=text,
                      total_tokens=total, total_steps=step + 1, elapsed_s=elapsed)


def visible_text(fragment: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


# --- what the page says ---------------------------------------------------------------------------------------------

def test_a_step_splits_into_accepted_drafts_and_the_bonus_token():
    assert split_step(hand_event()) == (" b\n", " e")
    assert split_step(single_event(1, 7, "!", 4, 1.0)) == ("", "!")
    # cut by the token budget after the first accepted draft: no bonus token
    assert split_step(hand_event(new_tokens=[11], new_text=" b")) == (" b", "")


def test_the_answer_marks_multi_token_steps_and_escapes_text():
    events = [hand_event(), single_event(1, 7, "<|im_end|>", 4, 1.0)]
    page = answer_html(events)
    spans = re.findall(r'<span class="(tr-step[^"]*)" data-step="(\d)" data-tokens="(\d)"', page)
    assert spans == [("tr-step tr-multi", "0", "3"), ("tr-step", "1", "1")]
    assert '<span class="tr-draft"> b\n</span><span class="tr-bonus"> e</span>' in page
    assert "&lt;|im_end|&gt;" in page and "<|im_end|>" not in page
    assert visible_text(page) == " b\n e<|im_end|>"
    outlined = answer_html(events, current=1)
    assert re.findall(r'class="[^"]*tr-current[^"]*" data-step="(\d)"', outlined) == ["1"]


def test_the_answer_hides_special_tokens_and_the_events_keep_them():
    events = [hand_event(), single_event(1, 2, "<|im_end|>", 4, 1.0)]
    page = answer_html(events, hidden=("<|im_end|>", "<|im_start|>"))
    assert visible_text(page) == " b\n e" and "im_end" not in page
    assert events[1].new_tokens == [2] and events[1].new_text == "<|im_end|>"  # the event is untouched
    assert "im_end" not in lanes_html({"tr": RaceRun("tr", events)}, None, hidden=("<|im_end|>",))


def test_counters_measure_decoding_time_and_name_the_key_number_once():
    c = Rates(steps=4, tokens=10, seconds=2.0)
    assert (c.mean_accepted_tokens, c.tokens_per_s) == (2.5, 5.0)
    page = counters_html(c, "running")
    values = dict(re.findall(r'data-key="(\w+)" data-value="([\d.]+)"', page))
    assert values == {"steps": "4", "tokens": "10", "tokens_per_pass": "2.50", "tokens_per_s": "5.0"}
    assert "tokens per forward pass (bonus token included)" in page and "decoding steps (forward passes)" in page
    assert "mean accepted" not in page
    assert Rates().tokens_per_s == 0.0


def test_counters_show_one_speed_per_method_and_the_one_speedup():
    baseline = Baseline(4.0, 50.0, "one plain decoding of your prompt to the same 10 tokens", True)
    assert "so far" not in visible_text(counters_html(Rates(4, 10, 2.0), "finished", baseline=baseline))
    page = counters_html(Rates(steps=4, tokens=10, seconds=2.0), "finished", baseline=baseline)
    values = dict(re.findall(r'data-key="(\w+)" data-value="([\d.]+)"', page))
    # the run's tokens/s (10 tokens in 2 s) over plain's, as tr_core.stats.speedup defines it: nothing else
    assert values["tokens_per_s"] == "5.0" and values["plain_tokens_per_s"] == "4.0" and values["speedup"] == "1.25"
    assert values["speedup"] == f"{speedup(5.0, 4.0):.2f}"
    text = visible_text(page)
    assert "one plain decoding of your prompt to the same 10 tokens; 50.0 ms per decoding step" in text
    status = re.search(r'<div class="tr-status">(.*?)</div>', page).group(1)
    assert "Plain decoding gave the very same tokens." in status and SPEEDUP_DEFINITION in text
    assert "<details" in page and SPEEDUP_DEFINITION not in status  # how plain was measured: folded, in the details
    differs = counters_html(Rates(4, 10, 2.0), baseline=Baseline(4.0, 50.0, "x", False))
    assert "DIFFER" in visible_text(differs)
    # while plain decoding is measured after the run: the speed so far, and no paragraph yet
    so_far = visible_text(counters_html(Rates(2, 5, 1.0), "running", baseline=Baseline(4.0, 50.0, "y", None, False)))
    assert "plain decoding's speed, so far" in so_far and "Plain decoding: y" not in so_far


def test_first_different_token():
    assert first_different_token([1, 2, 3], [1, 2, 3]) is None
    assert first_different_token([1, 2, 3], [1, 5, 3]) == 1
    assert first_different_token([1, 2], [1, 2, 3]) == 2


def race_runs(plain_s: float = 0.5, tr_s: float = 0.5, tr_ms: float = 400.0) -> dict[str, RaceRun]:
    """plain: 4 tokens in 4 steps of ``plain_s`` (100 ms each, so 4 tokens in 0.4 s of steps); tr: the same tokens in
    2 steps of ``tr_s`` (each ``tr_ms``); pld: plain's timing, differs at token 2."""
    def one(i, t, total, elapsed):
        return hand_event(step=i, accepted_path=[0], bonus_token=t, new_tokens=[t], new_text=f" w{t}",
                          total_tokens=total, total_steps=i + 1, elapsed_s=elapsed, forward_ms=90.0, overhead_ms=10.0)
    plain = [one(i, t, i + 1, plain_s * (i + 1)) for i, t in enumerate([1, 2, 3, 4])]
    tr = [hand_event(step=0, new_tokens=[1, 2], new_text=" w1 w2", total_tokens=2, total_steps=1, elapsed_s=tr_s,
                     forward_ms=tr_ms, overhead_ms=0.0),
          hand_event(step=1, new_tokens=[3, 4], new_text=" w3 w4", total_tokens=4, total_steps=2, elapsed_s=2 * tr_s,
                     forward_ms=tr_ms, overhead_ms=0.0)]
    pld = [one(i, t, i + 1, plain_s * (i + 1)) for i, t in enumerate([1, 2, 9, 4])]
    return {"plain": RaceRun("plain", plain), "pld": RaceRun("pld", pld), "tr": RaceRun("tr", tr)}


def race_rounds(timings) -> dict[str, list[RaceRun]]:
    """One race of several rounds, ``timings`` giving each round's ``race_runs`` arguments."""
    rounds = [race_runs(*t) for t in timings]
    return {m: [r[m] for r in rounds] for m in rounds[0]}


def test_the_race_gives_each_methods_median_and_range_over_its_rounds():
    # stubbed timings: plain takes 2.0 s every round; tr 0.9 s, 1.1 s, 0.8 s (its tokens/s 4.4, 3.6, 5.0)
    rounds = race_rounds([(0.5, 0.45, 150.0), (0.5, 0.55, 160.0), (0.5, 0.4, 140.0)])
    summary = race_summary(rounds)
    tr = summary["tr"]
    assert tr.rounds == 3 and tr.tokens_per_s == Spread(4.444444444444445, 3.6363636363636362, 5.0)
    assert tr.speedup == Spread(2.2222222222222223, 1.8181818181818181, 2.5)
    assert tr.tokens_per_pass == 2.0 and tr.pass_cost == pytest.approx(1.5) and tr.steps == 2 and tr.identical
    assert summary["plain"].speedup == Spread(1.0, 1.0, 1.0) and summary["plain"].pass_cost == 1.0
    assert not summary["pld"].identical
    decode = lambda ids: "".join(f" w{i}" for i in ids)  # noqa: E731
    page = race_table_html(rounds, decode, tree="small")
    rows = re.findall(r'<tr data-method="(\w+)" data-identical="(\w+)" data-median="([\d.]+)" data-low="([\d.]+)" '
                      r'data-high="([\d.]+)" data-speedup="[\d.]+" data-speedup-low="[\d.]+" '
                      r'data-speedup-high="[\d.]+"><td>[^<]*</td><td class="tr-\w+">[^<]*</td><td>([^<]*)</td>'
                      r'<td>([^<]*)</td><td>([\d.]+)</td><td class="tr-minor">([\d.]+)×</td>', page)
    assert rows == [("plain", "true", "2.0", "2.0", "2.0", "2.0 (2.0–2.0)", "1.00× (1.00–1.00×)", "1.00", "1.00"),
                    ("pld", "false", "2.0", "2.0", "2.0", "2.0 (2.0–2.0)", "1.00× (1.00–1.00×)", "1.00", "1.00"),
                    ("tr", "true", "4.4", "3.6", "5.0", "4.4 (3.6–5.0)", "2.22× (1.82–2.50×)", "2.00", "1.50")]
    assert "tokens/s: median of 3 (range)" in page and "tokens per forward pass (bonus token included)" in page
    diff = re.search(r'<div class="tr-diff" data-method="pld">(.*?)</div>', page).group(1)
    assert "at token 2" in diff and "<del> w3 w4</del><ins> w9 w4</ins>" in diff


def test_the_race_verdict_says_why_token_recycling_won_or_lost():
    won = race_summary(race_rounds([(0.5, 0.45, 150.0), (0.5, 0.55, 160.0), (0.5, 0.4, 140.0)]))
    assert race_verdict(won) == ("Token Recycling ran at 2.22× plain decoding (median of 3 rounds, range "
                                 "1.82–2.50×): each forward pass added 2.00 tokens (bonus token included) for 1.50× "
                                 "the cost of a one-token pass.")
    # each pass over the tree cost 4.5x a one-token pass: two tokens a pass do not pay for it
    lost = race_summary(race_rounds([(0.5, 1.2, 450.0), (0.5, 1.1, 440.0), (0.5, 1.3, 460.0)]))
    assert race_verdict(lost) == ("Token Recycling ran at 0.83× plain decoding (median of 3 rounds, range "
                                  "0.77–0.91×): each forward pass added only 2.00 tokens (bonus token included) but "
                                  "cost 4.50× a one-token pass.")
    # without Token Recycling in the race: the fastest method raced, and a difference from plain is said
    no_tr = {m: runs for m, runs in race_rounds([(0.5, 0.5, 400.0)]).items() if m != "tr"}
    assert race_verdict(race_summary(no_tr)).startswith("Prompt Lookup Decoding ran at 1.00× plain decoding (median "
                                                        "of 1 round, range 1.00–1.00×)")
    assert race_verdict(race_summary(no_tr)).endswith("; its output differed from plain decoding's (see below the "
                                                      "table).")


def test_race_lanes_show_what_each_run_had_at_a_moment():
    runs = race_runs()
    at = lanes_html(runs, 0.6)
    lanes = dict(re.findall(r'data-method="(\w+)">.*?<div class="tr-lane-foot">([^<]*)</div>', at))
    assert lanes == {"plain": "1 tokens in 1 decoding steps, 0.6 s", "pld": "1 tokens in 1 decoding steps, 0.6 s",
                     "tr": "2 tokens in 1 decoding steps, 0.6 s"}
    assert "done, 4.0 tokens/s" in lanes_html(runs, 1.2)
    assert "waiting to be measured" in lanes_html({"plain": runs["plain"], "tr": None}, None)


def test_history_lists_newest_first():
    s = Session()
    s.record("live", "small", 8, "shipped", Rates(16, 8, 4.0))
    s.record("live", "small", 8, "shipped + 1 runs", Rates(16, 5, 3.2))
    page = history_html(s.history)
    assert [r for r in re.findall(r"<tr><td>(\d)</td>", page)] == ["2", "1"]
    assert "2.00" in page and "3.20" in page
    assert "No runs yet" in history_html([])


# --- choices, hot start, the model cache and the session ------------------------------------------------------------

def test_tree_choices_list_the_fitted_tree_then_every_template(tmp_path):
    assert tree_names((tmp_path,)) == ["auto"] + list(BUILTIN_TEMPLATES)
    (tmp_path / "wide.json").write_text(json.dumps({"branching": {"": 2, "0": 1}}))
    (tmp_path / "broken.json").write_text("{not json")
    choices = tree_choices((tmp_path,))
    assert [name for _, name in choices] == ["auto"] + list(BUILTIN_TEMPLATES) + ["wide"]  # broken.json left out
    labels = {name: label for label, name in choices}
    assert labels["auto"] == "auto: fitted to the model and this machine"
    assert labels["paper"] == "paper: the paper's tree, 80 draft nodes" and labels["wide"] == "wide: 3 draft nodes"


def test_the_tree_note_says_what_the_run_drafts_with():
    tree = SimpleNamespace(size=10, name="auto")
    fitted = SimpleNamespace(predicted_speedup=1.234, context=256, table=[])
    assert tree_note(SimpleNamespace(tree=tree, fitted=fitted, adaptive=False), "auto") == \
        "tree auto: 9 draft nodes fitted to this machine (predicted 1.23× over plain decoding, per step over a " \
        "256-token context)"
    assert tree_note(SimpleNamespace(tree=tree, fitted=fitted, adaptive=True), "auto").startswith(
        "tree auto: starts at 9 draft nodes fitted to this machine (predicted 1.23× over plain decoding, per step "
        "over a 256-token context), then sizes each step's tree by the step times it measures")
    fitted.table = [dict(nodes=n, step_ms=10.0 + n) for n in range(1, 21)]  # the step times it was fitted on
    assert tree_note(SimpleNamespace(tree=tree, fitted=fitted, adaptive=False), "auto") == \
        "tree auto: 9 draft nodes fitted to this machine (predicted 1.23× over plain decoding, per step over a " \
        "256-token context; verifying them, 10 rows with the root, costs 1.82× a one-token step here, 20 rows would " \
        "cost 2.73×)"
    small = SimpleNamespace(size=13, name="small")
    assert tree_note(SimpleNamespace(tree=small, fitted=None), "auto") == \
        "tree auto: no acceptance statistics for this model, so the small tree (12 draft nodes)"
    assert tree_note(SimpleNamespace(tree=small, fitted=None), "small") == "tree small: 12 draft nodes"
    table = [dict(nodes=n, predicted_speedup=1.3 - 0.01 * n) for n in range(1, 20)]  # stubbed predictions
    best = SimpleNamespace(table=table, tree=SimpleNamespace(size=3), predicted_speedup=1.27)
    assert tree_note(SimpleNamespace(tree=small, fitted=None), "small", best) == (
        "tree small: 12 draft nodes (a tree of its size is predicted at 1.17× plain decoding per step here; the size "
        "that pays most here, 2 draft nodes (tree auto), at 1.27×)")
    empty = SimpleNamespace(tree=SimpleNamespace(size=1, name="auto"), fitted=fitted, adaptive=False)
    assert tree_note(empty, "auto").startswith("tree auto: no draft nodes to start with: on this machine, verifying")
    assert tree_note(empty, "auto").endswith(
        "so the fitted tree is plain decoding; pick another tree to watch drafting")
    empty.adaptive = True
    assert tree_note(empty, "auto").endswith("then sizes each step's tree by the step times it measures (the "
                                             "tree-budget chart shows why)")


def test_a_method_that_ignores_the_tree_says_what_it_drafts_with_instead():
    size = dict(width=3, n=4, guesses=2, why="stubbed")
    engine = SimpleNamespace(lookahead_size=lambda: size)
    assert draft_note(engine, "lookahead", "small") == (
        "Lookahead window of 3 guesses, n-grams of 4, up to 2 verified a step (stubbed); the tree picked applies to "
        "Token Recycling only")
    assert draft_note(engine, "rest", "small").startswith("drafts a trie of the datastore's continuations")
    tree = SimpleNamespace(size=13, name="small")
    fitted = SimpleNamespace(table=[], tree=tree)
    assert draft_note(SimpleNamespace(tree=tree, fitted=fitted, adaptive=False), "tr", "small") == \
        "tree small: 12 draft nodes"


def fake_engine(vocab: int, k: int, name: str = "org/My-Model"):
    return SimpleNamespace(vocab_size=vocab, config=SimpleNamespace(top_k=k),
                           model=SimpleNamespace(config=SimpleNamespace(_name_or_path=name)))


def test_the_starting_matrix_is_the_models_shipped_one(tmp_path):
    engine = fake_engine(50, 4)
    matrix, note = starting_matrix(engine, True, tmp_path)
    assert note == "cold start: no hot-start matrix is shipped for my-model (assets/hot_start/)"
    assert not matrix.rows.any()
    saved = AdjacencyMatrix(50, 8)
    saved.rows = torch.randint(0, 50, (50, 8), dtype=torch.int32)
    saved.save(tmp_path / "my-model-k8.safetensors")
    saved.save(tmp_path / "other-model-k4.safetensors")  # another model's: never used for this one
    matrix, note = starting_matrix(engine, True, tmp_path)
    assert note == "hot start from the shipped matrix my-model-k8.safetensors"
    assert torch.equal(matrix.rows, saved.rows[:, :4])  # a smaller k keeps the top ranks
    matrix, note = starting_matrix(fake_engine(60, 4), True, tmp_path)
    assert note.startswith("cold start: no shipped matrix fits") and "vocabulary of 50" in note
    matrix, note = starting_matrix(engine, False, tmp_path)
    assert note == "cold start: an empty matrix (hot start is off)" and not matrix.rows.any()


def test_the_default_model_falls_back_to_the_hub_when_the_package_is_missing(monkeypatch):
    calls = []

    def fake_load(model_id, config):
        calls.append(model_id)
        if model_id is None:
            raise ModelLoadError("the embedded model package is not installed")
        return f"engine for {model_id}"

    monkeypatch.setattr(models_mod.importlib.util, "find_spec", lambda name: None)
    assert models_mod.load_default_engine(fake_load) == f"engine for {EMBEDDED_HUB_ID}"
    assert calls == [None, EMBEDDED_HUB_ID]
    # with the package present, its error is the one to see
    monkeypatch.setattr(models_mod.importlib.util, "find_spec", lambda name: object())
    with pytest.raises(ModelLoadError, match="not installed"):
        models_mod.load_default_engine(fake_load)


def test_the_model_cache_loads_each_model_once_and_keeps_the_default():
    calls = []

    def fake_load(model_id, config):
        calls.append(model_id)
        if model_id == "bad/id":
            raise ModelLoadError("could not load model id 'bad/id'")
        return SimpleNamespace(name=model_id)

    models = ModelCache(keep=2, load=fake_load)
    assert models.get("").name is None and models.get(" ").name is None and calls == [None]
    for _ in range(2):  # a failure is not cached: the next try loads again
        with pytest.raises(ModelLoadError):
            models.get("bad/id")
    assert calls == [None, "bad/id", "bad/id"]
    models.get("a/one")
    models.get("b/two")  # evicts a/one, never the default
    assert models.loaded("") and models.loaded("b/two") and not models.loaded("a/one")


def test_the_model_cache_keeps_one_copy_per_mode():
    modes = []

    def fake_load(model_id, config):
        modes.append((model_id, config.mode))
        return SimpleNamespace(name=model_id, mode=config.mode)

    models = ModelCache(keep=2, load=fake_load)
    assert models.get("").mode == "exact" and models.get("", "fast").mode == "fast"
    assert models.get("").mode == "exact" and models.get("", "fast").mode == "fast"  # each loaded once
    assert modes == [(None, "exact"), (None, "fast")]
    assert models.loaded("", "exact") and models.loaded("", "fast") and not models.loaded("a/one", "fast")


def test_the_apps_start_loads_both_modes_with_one_kernel_measurement(capsys):
    # the first load (exact: the page's mode until measured) times the fast mode's candidates too, which the fast
    # mode's load then reads (tr_core.speed.layouts.every_mode_at_once): one measurement of the layouts, not two
    from tr_core.speed import layouts

    seen = []

    class Models:
        def get(self, model_id="", mode="exact"):
            seen.append((mode, layouts._EVERY_MODE))

        def measure_modes(self):
            seen.append(("which mode is faster", layouts._EVERY_MODE))
            return "fast", "measured"

    app.preload(Models())
    assert seen == [("exact", True), ("fast", True), ("which mode is faster", False)]
    assert "default mode: fast (measured)" in capsys.readouterr().out


def test_prepare_measures_what_a_first_start_does_and_serves_nothing(monkeypatch, capsys):
    # `python app.py --prepare`: the start's loads and measurement (preload), what was chosen, exit status 0; 1 where
    # the model did not load; no page is built or served either way
    from tr_core.models import ModelLoadError

    calls, fail = [], []

    class Models:
        def get(self, model_id="", mode="exact"):
            calls.append(mode)
            if fail:
                raise ModelLoadError("no weights here")

        def measure_modes(self):
            return "fast", "measured"

        def describe(self, model_id="", mode="exact"):
            return f"the model, {mode} first: kernels chosen here"

    monkeypatch.setattr(app, "ModelCache", Models)
    monkeypatch.setattr(app, "build_app", lambda *a, **k: pytest.fail("--prepare builds no page"))
    with pytest.raises(SystemExit) as done:
        app.main(["--prepare"])
    assert done.value.code == 0 and calls == ["exact", "fast"]
    assert "the model, fast first: kernels chosen here" in capsys.readouterr().out
    fail.append(True)
    with pytest.raises(SystemExit) as done:
        app.main(["--prepare"])
    assert done.value.code == 1 and "the default model did not load: no weights here" in capsys.readouterr().out


def test_a_session_keeps_its_matrix_across_runs_as_rows_over_a_shared_start(tiny_folder):
    _, model, tokenizer = tiny_folder
    small = Engine(model, tokenizer).with_config(tree="small")
    s = Session()
    first, note = s.matrix_for(small, "", hot_start=True)
    assert note.startswith("cold start: no hot-start matrix is shipped") and s.matrix_delta is None
    shared = s.matrix_base
    assert first is not shared and torch.equal(first.rows, shared.rows)  # a working copy of the shared start
    assert s.begin_live("", "exact", "small", hot_start=True) is s.live and s.runs_on_matrix == 1
    first.update(torch.tensor([5, 9]), torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8], [8, 7, 6, 5, 4, 3, 2, 1]]))
    s.keep_matrix(first)  # what the run taught: two rows
    assert s.matrix_delta.index.tolist() == [5, 9] and not shared.rows.any(), "the shared start is never changed"
    again, note = s.matrix_for(small.with_config(tree="tiny"), "", hot_start=True)
    assert torch.equal(again.rows, first.rows) and again is not first and note.endswith("taught by your 1 earlier run")
    _, note = s.matrix_for(small, "", hot_start=True, prompt="")  # the run above was on the prompt ""
    assert note.endswith("then taught by your 1 earlier run, 1 of them on this prompt")
    assert s.matrix_for(small, "", hot_start=True, prompt="other")[1].endswith("0 of them on this prompt")
    assert s.matrix_history("", True) == "an empty matrix + 1 run of yours, 1 on this prompt"
    cold, note = s.matrix_for(small, "", hot_start=False)
    assert not cold.rows.any() and "hot start is off" in note and s.matrix_delta is not None
    other_k, _ = s.matrix_for(small.with_config(top_k=4), "", hot_start=True)  # another k: a new matrix
    assert other_k.k == 4 and s.matrix_delta is None and s.runs_on_matrix == 0
    assert copy.deepcopy(s).matrix_base is s.matrix_base  # gr.State's copy for a new user shares the start


def test_a_sessions_state_is_what_its_runs_changed_and_their_records(tiny_models):
    """The per-session bytes: the shared starting matrix is never in them; a run adds the rows it rewrote (a few
    hundred bytes each) and its record; 10,000 idle sessions after one such run each fit in well under 1 GB."""
    session = Session()
    empty = session.state_bytes
    run = LiveRun(session, tiny_models, settings())
    run.prepare()
    list(run.snapshots())
    delta = session.matrix_delta
    assert delta is not None and 0 < len(delta.index) <= 13 * len(session.live.events)  # at most the tree's rows
    assert delta.nbytes == len(delta.index) * (8 + 4 * 8)  # int64 index, k = 8 int32 ids
    grown = session.state_bytes - empty
    matrix_bytes = run.matrix.nbytes
    print(f"empty session {empty} B; after a 12-token run {session.state_bytes} B ({len(delta.index)} rows kept: "
          f"{delta.nbytes} B, against {matrix_bytes} B for a whole matrix of this model)")
    assert session.state_bytes < matrix_bytes  # less than one copy of the matrix
    assert 10_000 * session.state_bytes < 2**30, "10,000 such sessions fit in 1 GB"
    assert grown > delta.nbytes  # the record of the run is counted too


# --- one run, from checked settings to the record (ui.run), on a tiny model ------------------------------------------

TREES = ["auto", "small", "tiny", "paper"]


@pytest.fixture()
def tiny_models(tiny_folder):
    _, model, tokenizer = tiny_folder
    return ModelCache(load=lambda model_id, config: Engine(model, tokenizer, config))


def settings(max_new_tokens=12, tree="small", top_k=8, hot_start=True, prompt="Name three colours.", method="tr",
             race=("pld", "tr"), sampling=(0.0, 1.0, 0, 0), race_matrix="shipped"):
    temperature, top_p, sample_top_k, seed = sampling
    return Settings.check(prompt=prompt, max_new_tokens=max_new_tokens, tree=tree, top_k=top_k, hot_start=hot_start,
                          model_id="", mode="exact", method=method, race_methods=race, race_matrix=race_matrix,
                          temperature=temperature, top_p=top_p, sample_top_k=sample_top_k, seed=seed, trees=TREES)


def test_sampling_settings_are_checked_with_the_controls_names():
    assert settings().sampling.is_greedy and settings().sampling.describe() == "greedy"
    s = settings(sampling=(0.7, 0.9, 50, 3)).sampling
    assert (s.temperature, s.top_p, s.sample_top_k, s.seed) == (0.7, 0.9, 50, 3)
    for values, message in [((-0.1, 1.0, 0, 0), "Temperature must be a number from 0 to 2; got -0.1."),
                            ((float("nan"), 1.0, 0, 0), "Temperature must be a number from 0 to 2; got nan."),
                            ((0.7, 0.0, 0, 0), "Top-p must be a number from 0.01 to 1; got 0.0."),
                            ((0.7, "0.9", 0, 0), "Top-p must be a number from 0.01 to 1; got '0.9'."),
                            ((0.7, 1.0, 2.5, 0), "Sampling top-k (0 = no filter) must be a whole number from 0 to "
                                                 "1000; got 2.5."),
                            ((0.7, 1.0, 0, -1), "Seed must be a whole number from 0 to 2147483647; got -1.")]:
        with pytest.raises(InputError) as refused:
            settings(sampling=values)
        assert str(refused.value) == message


def test_a_sampled_race_gives_every_method_plain_samplings_tokens(tiny_models):
    """With one seed, every method samples the same tokens as plain decoding (tr_core.sampling), so the race's
    identical-to-plain check still means something; another seed samples another answer."""
    def race_tokens(sampling) -> dict:
        race = Race(Session(), tiny_models, settings(sampling=sampling, race=("pld", "tr", "tr-context")))
        race.prepare()
        list(race.progress())
        rounds = race.session.race.rounds
        assert race.session.race.runs["tr"].events[0].sampling.startswith("sampled: T=1")
        shown = race_table_html(rounds, race.decode, "small") + lanes_html(race.session.race.runs, None)
        assert "plain decoding" in shown and "greedy" not in shown  # a sampled race's baseline is not greedy
        return {m: [run.token_ids for run in runs] for m, runs in rounds.items()}

    first = race_tokens((1.0, 0.95, 0, 11))
    plain = first["plain"][0]
    assert all(ids == plain for runs in first.values() for ids in runs)
    assert race_tokens((1.0, 0.95, 0, 12))["plain"][0] != plain


def test_settings_are_checked_and_name_the_first_refused():
    assert settings().max_new_tokens == 12 and settings().prompt.text == "Name three colours."
    with pytest.raises(InputError, match="Unknown draft tree 'huge'"):
        settings(tree="huge")
    with pytest.raises(InputError, match="Max new tokens must be a whole number"):
        Settings.check(prompt="hi", max_new_tokens=0, tree="huge", top_k=8, hot_start=True, model_id="",
                       mode="exact", trees=TREES)


def test_a_live_run_gives_one_snapshot_per_step_and_leaves_its_record(tiny_models):
    session = Session()
    run = LiveRun(session, tiny_models, settings())
    assert run.needs_loading
    run.prepare()
    assert not run.needs_loading and "tree small: 12 draft nodes" in run.note and "cold start" in run.note
    snaps, counts = [], []
    for snap in run.snapshots():
        snaps.append(snap)
        counts.append(len(snap.events))  # the run's own list grows: count it as it comes
    assert [s.done for s in snaps] == [False] * (len(snaps) - 1) + [True] and not snaps[-1].stopped
    events = snaps[-1].events
    decoding = [s for s in snaps[:-1] if not s.measuring_plain]
    measuring = [s for s in snaps[:-1] if s.measuring_plain]
    assert snaps[:-1] == decoding + measuring  # the run's steps first, then plain decoding's
    # one snapshot per step of the run but the last (it finishes the run), no plain decoding beside them
    assert counts[:len(decoding)] == list(range(1, len(events))) and all(s.baseline is None for s in decoding)
    # then plain decoding of the same prompt, timed on its own to the run's token count: one snapshot as it starts,
    # one per step of its own after that, its speed so far in each
    assert measuring and measuring[0].baseline is None
    plain_tokens = [int(s.baseline.source.split(": ")[1].split(" tokens")[0]) for s in measuring[1:]]
    assert plain_tokens == list(range(1, 13)) and all(len(s.events) == len(events) for s in measuring)
    for snap, tokens in zip(measuring[1:], plain_tokens):
        assert snap.baseline.source.startswith("plain decoding of your prompt, measured right after your run so far")
        assert snap.baseline.identical is None and not snap.baseline.final
        # the speedup so far compares the same stretch: the run's rate over its first steps that reached as many
        # tokens as plain decoding has, not over the whole answer against plain decoding's first tokens
        reached = next(e for e in events if e.total_tokens >= tokens)
        assert snap.baseline.run_tokens_per_s == pytest.approx(reached.total_tokens / reached.elapsed_s)
        tile = re.search(r'data-key="speedup" data-value="([\d.]+)"', counters_html(snap.rates, "", "", snap.baseline))
        assert float(tile.group(1)) == round(snap.baseline.run_tokens_per_s / snap.baseline.tokens_per_s, 2)
    baseline = snaps[-1].baseline
    assert baseline.tokens_per_s > 0 and baseline.ms_per_token > 0 and session.live.baseline is baseline
    assert baseline.source.startswith("plain decoding of your prompt, measured right after your run: 12 tokens, ")
    assert baseline.identical is True  # plain decoding gave the run's very tokens
    summary = session.live.summary
    assert summary["speedup"] == round(speedup(snaps[-1].rates.tokens_per_s, baseline.tokens_per_s), 4)
    assert summary["speedup_definition"] == SPEEDUP_DEFINITION and summary["identical_to_plain"] is True
    assert summary["tokens_per_forward_pass"] == round(snaps[-1].rates.mean_accepted_tokens, 3)
    assert summary["matrix_history"] == "an empty matrix, no run of yours yet"
    assert not snaps[-1].drafted_nothing  # the small tree drafts
    assert snaps[-1].rates.tokens == 12 == sum(len(e.new_tokens) for e in events)
    assert snaps[-1].rates.steps == len(events) and snaps[-1].rates.seconds > 0
    # the session keeps the finished record compressed, its events and names read back whole
    assert session.live.packed and not session.live.steps and session.live.events == events
    assert len(session.live.packed) < len(pickle.dumps(events)) and session.live.tree == "small"
    named = {t for e in events for t in e.tree_tokens + e.predicted + [r for u in e.rows_updated for r in u.new]}
    assert named <= set(session.live.names)  # every token a figure may label has its text, for /step
    assert session.live.token_text(events[0].tree_tokens[0]) == tiny_models.get("").tokenizer.decode(
        [events[0].tree_tokens[0]])
    assert [h["what"] for h in session.history] == ["live"] and session.runs_on_matrix == 1
    assert len(session.matrix_delta.index) > 0, "the run taught the session's own matrix"


def test_plain_decoding_after_the_run_steps_to_its_token_count_and_counts_only_its_own_time(monkeypatch):
    """Plain decoding measured after a run takes one timed step at a time up to the run's token count, no further;
    its clock counts only its own steps (stubbed: each plain step takes 0.1 s; the page's frames and waits between
    them are not counted)."""
    now = [0.0]
    monkeypatch.setattr("ui.run.time.perf_counter", lambda: now[0])

    def stream(ids, n, method, sampling):
        assert method == "plain" and n == 5
        for i in range(5):
            now[0] += 0.1
            yield single_event(i, 20 + i, "x", i + 1, 99.0)

    plain = PlainAlongside(SimpleNamespace(stream=stream), [1, 2], 5, None)
    assert plain.baseline([]) is None
    assert plain.step(3) and plain.step(3) and plain.step(3)
    assert not plain.step(3)  # the run's token count reached: no step further
    assert plain.tokens == 3 and len(plain.events) == 3 and plain.seconds == pytest.approx(0.3)
    now[0] += 7.0  # a frame and the wait after it: not plain decoding's time
    assert plain.step(5) and plain.tokens == 4 and plain.seconds == pytest.approx(0.4)
    assert plain.step(5) and not plain.step(6)  # the stream finished: nothing more to take
    run = [hand_event(new_tokens=[20, 21, 22], total_tokens=3), single_event(1, 23, "x", 4, 1.0),
           single_event(2, 24, "x", 5, 1.0)]
    final = plain.baseline(run, final=True)
    assert final.tokens_per_s == pytest.approx(5 / 0.5) and final.identical is True
    assert [e.elapsed_s for e in plain.events] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert plain.baseline(run[:1] + [single_event(1, 99, "y", 4, 1.0)] + run[2:], final=True).identical is False
    assert "so far" in plain.baseline(run).source and plain.baseline(run).identical is None


def test_no_garbage_collection_runs_inside_a_timed_step_of_a_live_run_or_of_plain_beside_it(tiny_models, monkeypatch):
    """A full collection scans every object of the app's process (up to 389 ms in test_app.py's runs): inside a timed
    step it would be billed to that method. Every step of the run and of plain decoding beside it runs with the
    collector paused; between steps (the page's drawing) it is on."""
    import gc

    import tr_core.decoding as decoding

    real, during = decoding.verify_step, []
    monkeypatch.setattr(decoding, "verify_step", lambda *a, **k: during.append(gc.isenabled()) or real(*a, **k))
    run = LiveRun(Session(), tiny_models, settings())
    run.prepare()
    between = [gc.isenabled() for _ in run.snapshots()]
    assert len(during) >= len(between) - 1 > 0 and not any(during)  # the run's steps and plain's, all paused
    assert all(between) and gc.isenabled()


def test_no_garbage_collection_runs_inside_a_timed_run_of_the_race(tiny_models, monkeypatch):
    """As in Live: every step of every run of the race with the collector paused; on between runs."""
    import gc

    import tr_core.decoding as decoding

    real, during = decoding.verify_step, []
    monkeypatch.setattr(decoding, "verify_step", lambda *a, **k: during.append(gc.isenabled()) or real(*a, **k))
    race = Race(Session(), tiny_models, settings(race=("tr",)))
    race.prepare()
    between = [gc.isenabled() for _ in race.progress()]
    warm_up = 1  # the one-token warm-up before the race, not timed
    assert len(during) > warm_up + 2 * race.rounds and not any(during[warm_up:])
    assert all(between) and gc.isenabled()


def test_the_collector_pause_nests_and_spans_threads():
    import gc
    import threading

    from tr_core.stats import collector_paused

    with collector_paused():
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    inside, leave = threading.Event(), threading.Event()

    def hold():
        with collector_paused():
            inside.set()
            leave.wait(5)
    other = threading.Thread(target=hold)
    other.start()
    inside.wait(5)
    with collector_paused():
        pass
    assert not gc.isenabled()  # the other thread's block still runs
    leave.set()
    other.join(5)
    assert gc.isenabled()
    gc.disable()  # off before: it stays off
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_live_runs_record_is_packed_once_its_final_frame_is_shown_or_the_run_is_dropped(tiny_models):
    session = Session()
    run = LiveRun(session, tiny_models, settings())
    run.prepare()
    steps = run.snapshots()
    final = next(snap for snap in steps if snap.done)
    assert not session.live.packed and session.live.steps is final.events  # the final frame draws from the list
    steps.close()  # gradio drops the generator (the browser went away) instead of asking for the end
    assert session.live.packed and not session.live.steps and session.live.events == final.events


def test_stop_ends_a_live_run_after_the_step_in_progress(tiny_models):
    session = Session()
    run = LiveRun(session, tiny_models, settings(max_new_tokens=64))
    run.prepare()
    snaps = []
    for snap in run.snapshots():
        snaps.append(snap)
        if len(snaps) == 3:
            run.stop()
    assert len(snaps) == 4 and snaps[-1].done and snaps[-1].stopped and snaps[-1].baseline is None
    assert len(snaps[-1].events) == 3 and snaps[-1].rates.tokens < 64
    assert [h["what"] for h in session.history] == ["live (stopped)"] and len(session.live.events) == 3


def test_a_live_run_refuses_a_tree_that_needs_a_larger_k_in_the_controls_words(tiny_models):
    run = LiveRun(Session(), tiny_models, settings(tree="paper", top_k=4))
    with pytest.raises(InputError) as refused:
        run.prepare()
    assert str(refused.value) == ("The paper tree drafts a row's 8 likeliest candidates, so 'k: candidates per row' "
                                  "must be at least 8; it is 4. Raise k, or pick a smaller tree.")


def test_plain_decoding_is_its_own_baseline_and_an_empty_auto_tree_says_it_drafted_nothing(tiny_models):
    session = Session()
    run = LiveRun(session, tiny_models, settings(method="plain"))
    run.prepare()
    final = list(run.snapshots())[-1]
    assert final.baseline.source == "this run itself is plain decoding" and not final.drafted_nothing
    assert "<|im_start|>" in run.hidden and "<|im_end|>" in run.hidden  # the special tokens the page hides
    empty = [hand_event(tree_tokens=[10], tree_parents=[-1], tree_ranks=[0], tree_text=["a"], predicted=[11],
                        accepted_path=[0], bonus_token=11, new_tokens=[11], new_text=" b")]
    auto = LiveRun(session, tiny_models, settings(tree="auto"))
    auto.record = SimpleNamespace(events=empty)
    assert auto.drafted_nothing
    auto.record = SimpleNamespace(events=empty + [hand_event()])  # one step drafted: the tree paid at times
    assert not auto.drafted_nothing
    small = LiveRun(session, tiny_models, settings(tree="small"))
    small.record = SimpleNamespace(events=empty)
    assert not small.drafted_nothing  # a tree the user picked: nothing to say


def test_a_race_measures_each_method_on_a_copy_of_the_matrix(tiny_models):
    session = Session()
    live = LiveRun(session, tiny_models, settings())
    live.prepare()
    list(live.snapshots())
    taught = session.matrix_delta.applied_to(session.matrix_base).rows.clone()
    from_session = Race(session, tiny_models, settings(race_matrix="session"))
    from_session.prepare()  # the option: a copy of what the session's live run taught
    assert torch.equal(from_session.matrix.rows, taught) and from_session.matrix is not session.matrix_base
    assert from_session.matrix_history == ("a copy of your session's matrix: an empty matrix + 1 run of yours, 1 on "
                                           "this prompt")
    race = Race(session, tiny_models, settings())
    race.prepare()  # the default: the same starting matrix for every method, whatever the session's runs taught
    fresh, about = starting_matrix(race.engine, True)
    assert torch.equal(race.matrix.rows, fresh.rows) and not torch.equal(race.matrix.rows, taught)
    assert race.matrix_history.endswith(about) and race.start == "shipped"
    progress = list(race.progress())
    # three rounds, interleaved, each in an order rotated by one
    assert [p.status.split(" (")[0].split(", alone")[0] for p in progress] == [
        "Warming up", "Round 1 of 3, run 1 of 9: plain decoding", "Round 1 of 3, run 2 of 9: Prompt Lookup "
        "Decoding", "Round 1 of 3, run 3 of 9: Token Recycling", "Round 2 of 3, run 4 of 9: Prompt Lookup Decoding",
        "Round 2 of 3, run 5 of 9: Token Recycling", "Round 2 of 3, run 6 of 9: plain decoding",
        "Round 3 of 3, run 7 of 9: Token Recycling", "Round 3 of 3, run 8 of 9: plain decoding",
        "Round 3 of 3, run 9 of 9: Prompt Lookup Decoding", "Measured."]
    assert progress[-1].done and list(session.race.runs) == ["plain", "pld", "tr"]
    assert {m: len(runs) for m, runs in session.race.rounds.items()} == {"plain": 3, "pld": 3, "tr": 3}
    assert all(session.race.runs[m] in session.race.rounds[m] for m in ("plain", "pld", "tr"))  # the median round
    # every round of a matrix method starts from the same matrix: the rounds repeat the same work
    assert all(run.token_ids == session.race.rounds["plain"][0].token_ids and len(run.token_ids) == 12
               for runs in session.race.rounds.values() for run in runs)
    tr_rounds = session.race.rounds["tr"]
    assert [e.accepted_path for e in tr_rounds[0].events] == [e.accepted_path for e in tr_rounds[2].events]
    assert torch.equal(session.matrix_delta.applied_to(session.matrix_base).rows, taught), \
        "measuring does not teach the session's matrix"
    assert [h["what"] for h in session.history] == ["live", "race: plain", "race: pld", "race: tr"]
    assert session.trace()["race"]["runs"]["tr"][0]["method"] == "tr"
    assert session.race.matrix_history == race.matrix_history


def test_the_race_summary_gives_each_methods_figures_from_its_rounds(tiny_models):
    race = Race(Session(), tiny_models, settings())
    race.prepare()
    final = race_frame(list(race.progress())[-1], race, race.session)
    data, rounds = final["race_summary"], race.session.race.rounds
    assert final["race_status"] == data["verdict"] and not data["verdict"].endswith("…")  # final, not progress
    assert data["speedup_definition"] == SPEEDUP_DEFINITION and data["matrix_history"] == race.matrix_history
    for method, runs in rounds.items():
        figures = data["methods"][method]
        speeds = [r.events[-1].total_tokens / r.events[-1].elapsed_s for r in runs]
        assert figures["median_tokens_per_s"] == round(sorted(speeds)[1], 3)
        assert (figures["min_tokens_per_s"], figures["max_tokens_per_s"]) == (round(min(speeds), 3),
                                                                              round(max(speeds), 3))
        ratios = sorted(speedup(r.rates.tokens_per_s, p.rates.tokens_per_s) for r, p in zip(runs, rounds["plain"]))
        assert figures["speedup"] == round(ratios[1], 4) and figures["speedup_range"] == [round(ratios[0], 4),
                                                                                         round(ratios[2], 4)]
        assert figures["identical"] is True and figures["rounds"] == 3
    assert data["methods"]["plain"]["draft_nodes_per_step"] == 0 and data["methods"]["tr"]["draft_nodes_per_step"] > 0


def test_the_default_race_adds_the_best_method_beyond_the_paper_each_from_its_own_copy(tiny_models):
    session = Session()
    race = Race(session, tiny_models, Settings.check(prompt="Name three colours.", max_new_tokens=12, tree="small",
                                                     top_k=8, hot_start=True, model_id="", mode="exact", trees=TREES))
    race.prepare()
    assert race.methods == ("plain", "pld", "tr", "tr-context")
    starts = {m: e.matrix.rows.clone() for m, e in race.engines.items()}
    assert all(race.engines[m].matrix is not race.engines["tr"].matrix for m in ("pld", "tr-context"))
    progress = list(race.progress())
    assert progress[-1].done and list(session.race.runs) == ["plain", "pld", "tr", "tr-context"]
    plain = session.race.runs["plain"].token_ids
    assert all(run.token_ids == plain for run in session.race.runs.values())
    assert torch.equal(starts["tr"], starts["tr-context"]), "every matrix method starts from the same matrix"
    assert {e.method for e in session.race.runs["tr-context"].events} == {"tr-context"}


def test_live_runs_the_method_picked_and_a_bad_method_is_refused(tiny_models):
    session = Session()
    run = LiveRun(session, tiny_models, settings(method="tr-context"))
    run.prepare()
    snaps = list(run.snapshots())
    assert {e.method for e in snaps[-1].events} == {"tr-context"} and session.history[-1]["what"] == "live: tr-context"
    with pytest.raises(InputError, match="Unknown method 'beam'"):
        settings(method="beam")
    with pytest.raises(InputError, match="at least one method"):
        settings(race=())


def test_stop_ends_a_race_without_a_record(tiny_models):
    session = Session()
    race = Race(session, tiny_models, settings())
    race.prepare()
    seen = []
    for p in race.progress():
        seen.append(p)
        if p.status.startswith("Round 1 of 3, run 2"):
            race.stop()
    assert seen[-1].status == "Stopped." and seen[-1].stopped and session.race is None and not session.history


def test_the_stream_throttle_shows_the_first_step_then_every_interval():
    clock = iter([0.0, 0.04, 0.09, 0.11, 0.15, 0.30]).__next__
    due = Every(0.1, clock=clock)
    assert [due() for _ in range(6)] == [True, False, False, True, False, True]


# --- the launched app through its named endpoints (the embedded model) ----------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(app_models):
    app.preload(app_models)  # as `python app.py` does at start: the first Run then only decodes
    demo = app.build_app(app_models)
    _, url, _ = app.launch(demo, server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True,
                           quiet=True)
    yield url
    demo.close()


@pytest.fixture()
def client(served):
    from gradio_client import Client

    return Client(served, verbose=False)


LIVE = {name: i for i, name in enumerate(app.LIVE_OUTPUTS[:-1])}  # /live's outputs by name (the session is not one)


def node_markers(plot: dict) -> int:
    """Points drawn by a tree figure's node traces (the legend keys draw none)."""
    figure = json.loads(plot["plot"])
    return sum(len(t["x"]) for t in figure["data"] if t.get("mode") == "markers+text")


def test_live_streams_every_step_and_matches_plain_decoding(client, app_models):
    job = client.submit(PROMPT, NEW_TOKENS, "small", 8, True, "", api_name="/live")
    updates = list(job)
    answers = [u[0] for u in updates if isinstance(u[0], str) and "data-steps" in u[0]]
    steps = [int(re.search(r'data-steps="(\d+)"', a).group(1)) for a in answers]
    # the first step is always shown, then at most every FRAME_EVERY_S, and the last: the answer grows in order
    assert steps[0] == 1 and steps == sorted(steps) and len(set(steps)) >= 2, "the answer streams step by step"
    final = job.result()
    values = dict(re.findall(r'data-key="(\w+)" data-value="([\d.]+)"', final[1]))
    plain = app_models.get("").generate(PROMPT, NEW_TOKENS, method="plain")
    assert visible_text(final[0]) == plain.text, "Token Recycling through the app equals plain greedy decoding"
    assert int(values["tokens"]) == len(plain.token_ids)
    assert int(values["steps"]) == steps[-1] and float(values["tokens_per_s"]) > 0
    assert "finished" in final[1]
    # the status line speaks a learner's words; the kernels, formats and windows are folded in the details
    status = visible_text(re.search(r'<div class="tr-status">(.*?)</div>', final[1], re.S).group(1))
    assert "each step checked 12 guesses" in status and "so each step made" in status, status
    assert not [w for w in ("invariant", "F.linear", "W @", "window's") if w in status], status
    assert "<details" in final[1]
    trees = [u[2] for u in updates if isinstance(u[2], dict) and u[2].get("type") == "plotly"]
    assert trees and all(node_markers(t) == 13 + 1 for t in trees)  # the small tree's 13 nodes and the bonus
    assert "<td>live</td>" in final[LIVE["history_html"]]
    values = dict(re.findall(r'data-key="(\w+)" data-value="([\d.]+)"', final[1]))
    assert float(values["plain_tokens_per_s"]) > 0 and "Plain decoding: " in final[1]  # measured beside the run
    assert final[LIVE["step_chart"]]["type"] == "plotly"  # each decoding step against plain decoding's ms per token
    summary = final[LIVE["run_summary"]]  # the run's figures, as the counters show them
    assert summary["tokens"] == int(values["tokens"]) and f'{summary["speedup"]:.2f}' == values["speedup"]
    assert summary["identical_to_plain"] is True and summary["tree"] == "small" and summary["method"] == "tr"
    assert summary["draft_nodes_per_step"] == 12.0 and summary["speedup_definition"] == SPEEDUP_DEFINITION
    here, *others = summary["projection"]  # the same steps on other hardware: a model, this machine as measured
    assert here["device"] == "this machine" and here["speedup"] == round(summary["speedup"], 3)
    assert here["model_error"] >= 0 and not here["modelled"]
    assert [r["device"] for r in others] == ["laptop CPU", "T4", "A100", "H100"] and all(r["modelled"] for r in others)
    assert [r["model_error"] for r in others] == [None, None, 0.33, None]  # the A100's: the paper check
    assert json.loads(final[LIVE["projection_chart"]]["plot"])["data"][0]["y"][0] == "this machine (measured)"

    shown = client.predict(0, api_name="/step")  # the step slider: any step of this session's latest run
    assert re.findall(r'class="[^"]*tr-current[^"]*" data-step="(\d+)"', shown[0]) == ["0"]
    assert re.match(r"(?i)(decoding )?step 0 \(tr, tree small\)",
                    json.loads(shown[1]["plot"])["layout"]["title"]["text"])


def test_the_auto_tree_shows_its_budget_at_every_step(client):
    final = client.predict(PROMPT, 12, "auto", 8, True, "", api_name="/live")
    assert "sizes each step's tree by the step times it measures" in visible_text(final[1])
    title = json.loads(final[LIVE["budget_chart"]]["plot"])["layout"]["title"]["text"]
    assert re.match(r"step \d+: \d+ draft nodes", title), title
    shown = client.predict(0, api_name="/step")  # any step of the run: its own budget
    assert json.loads(shown[3]["plot"])["layout"]["title"]["text"].startswith("step 0: ")
    small = client.predict(PROMPT, 8, "small", 8, True, "", api_name="/live")  # a fixed tree has no budget
    assert "auto tree" in json.loads(small[LIVE["budget_chart"]]["plot"])["layout"]["annotations"][0]["text"]


def test_fast_mode_decodes_on_its_own_copy_in_the_format_measured_fastest(client, app_models):
    from tr_core.speed.kernels import mode_dtype, plan_of
    final = client.predict(PROMPT, 8, "small", 8, True, "", "fast", api_name="/live")
    fast = app_models.get("", "fast").model
    assert f"mode {mode_dtype('fast', fast)[1]}" in visible_text(final[1]) and "finished" in final[1]
    assert app_models.loaded("", "fast") and fast is not app_models.get("").model
    plan = plan_of(app_models.get("").model)
    assert plan is None or plan.fmt == "fp32"  # exact mode keeps its own fp32 model
    details = client.predict("", api_name="/load_model")
    assert "exact (fp32)" in details and "fast (" in details  # the model details name each mode's kernels
    # the mode selected in the tab comes first
    assert client.predict("", "fast", api_name="/load_model").split("on this machine: ", 1)[1].startswith("fast (")
    assert client.predict("", "exact", api_name="/load_model").split("on this machine: ", 1)[1].startswith("exact (")


def test_sessions_do_not_share_runs(client, served):
    from gradio_client import Client

    other = Client(served, verbose=False)
    client.predict(PROMPT, 8, "tiny", 8, True, "", api_name="/live")
    answer = other.predict(0, api_name="/step")[0]
    assert not isinstance(answer, str), "a new session has no run to show"
    reset = client.predict(api_name="/reset")
    assert "No runs yet" in reset[LIVE["history_html"]]


def test_the_race_measures_three_methods_in_rounds_and_checks_each_against_plain(client):
    status, _, table, _, steps, projection_chart, history, summary = client.predict(
        PROMPT, NEW_TOKENS, "small", 8, True, "", "exact", ["pld", "tr"], api_name="/race")
    assert summary["verdict"] == status and list(summary["methods"]) == ["plain", "pld", "tr"]
    rows = summary["projection"]  # Token Recycling's median round on other hardware, this machine as measured
    assert [r["device"] for r in rows] == ["this machine", "laptop CPU", "T4", "A100", "H100"]
    # the same measurement, rounded to 3 places in the projection and to 4 in the summary
    assert abs(rows[0]["speedup"] - summary["methods"]["tr"]["speedup"]) <= 0.00051 and rows[0]["method"] == "tr"
    bars = json.loads(projection_chart["plot"])["data"][0]
    assert bars["y"][0] == "this machine (measured)" and len(bars["x"]) == 5
    verdict = re.match(r"Token Recycling ran at [\d.]+× plain decoding \(median of 3 rounds, range [\d.]+–[\d.]+×\): "
                       r"each forward pass added (only )?[\d.]+ tokens \(bonus token included\) (for|but cost) [\d.]+×",
                       status)
    assert verdict, status
    rows = re.findall(r'<tr data-method="(\w+)" data-identical="(\w+)" data-median="([\d.]+)" data-low="([\d.]+)" '
                      r'data-high="([\d.]+)"[^>]*><td>[^<]*</td><td class="tr-\w+">[^<]*</td><td>[^<]*</td>'
                      r'<td>([\d.]+)×', table)
    assert [r[0] for r in rows] == ["plain", "pld", "tr"] and rows[0][5] == "1.00"
    for method, identical, median, low, high, ratio in rows:
        assert 0 < float(low) <= float(median) <= float(high)
        assert identical == "true", f"{method}'s output differs from plain decoding"  # as /live shows for it
    assert "tr-diff" not in table
    assert history.count("<td>race: ") == 3 and steps["type"] == "plotly"
    status, lanes, plot = client.predict(api_name="/replay")  # the side-by-side replay of those runs
    assert status.startswith("Token Recycling ran at") and lanes.count("— done,") == 3
    names = [t["name"] for t in json.loads(plot["plot"])["data"]]
    assert [n.split(":")[0] for n in names] == ["plain", "pld", "tr"]
    assert all(re.search(r": [\d.]+ \([\d.]+–[\d.]+\) tok/s$", n) for n in names), names  # median (range)


def test_a_race_at_temperature_0_7_samples_plain_decodings_answer_with_every_method(client):
    _, _, table, *_ = client.predict(PROMPT, NEW_TOKENS, "small", 8, True, "", "exact", ["pld", "tr"], 0.7, 1.0, 0,
                                     5, api_name="/race")
    identical = re.findall(r'<tr data-method="(\w+)" data-identical="(\w+)"', table)
    assert identical == [("plain", "true"), ("pld", "true"), ("tr", "true")], table
    status, lanes, plot = client.predict(api_name="/replay")
    assert status.startswith("Token Recycling ran at") and lanes.count("— done,") == 3
    names = [t["name"] for t in json.loads(plot["plot"])["data"]]
    assert [n.split(":")[0] for n in names] == ["plain", "pld", "tr"]
    assert all(re.search(r": [\d.]+ \([\d.]+–[\d.]+\) tok/s$", n) for n in names), names  # median (range)


def test_stop_ends_the_run_after_its_current_step(client):
    job = client.submit(PROMPT, 256, "small", 8, True, "", api_name="/live")
    for update in job:
        shown = re.search(r'data-steps="(\d+)"', update[0]) if isinstance(update[0], str) else None
        if shown and int(shown.group(1)) >= 3:
            break
    client.predict(api_name="/stop")  # the same session
    final = job.result()
    values = dict(re.findall(r'data-key="(\w+)" data-value="([\d.]+)"', final[1]))
    assert "stopped by you" in final[1] and int(values["steps"]) >= 3 and int(values["tokens"]) < 256
    assert "<td>live (stopped)</td>" in final[LIVE["history_html"]]
    assert final[LIVE["run_summary"]]["speedup"] is None  # stopped: plain decoding was not measured


def test_a_model_that_cannot_load_leaves_the_app_usable(client):
    with pytest.raises(Exception, match="could not load model id 'no-such-org/no-such-model'"):
        client.predict("no-such-org/no-such-model", api_name="/load_model")
    # a model page's web address is read as its hub id
    with pytest.raises(Exception, match="could not load model id 'no-such-org/no-such-model'"):
        client.predict("https://huggingface.co/no-such-org/no-such-model", api_name="/load_model")
    with pytest.raises(Exception, match="could not load model id"):
        client.predict(PROMPT, 8, "small", 8, True, "no-such-org/no-such-model", api_name="/live")
    final = client.predict(PROMPT, 8, "small", 8, True, "", api_name="/live")
    assert 'data-key="tokens" data-value="8"' in final[1]


def test_a_refused_request_shows_its_message_in_the_page_and_errs_for_the_api():
    def failing():
        yield "first"
        raise InputError("Type a prompt first: the box is empty. Or pick a Spec-Bench question below it.")

    stream = app._shown_errors(failing(), lambda message: f"shown: {message}")
    assert next(stream) == "first"
    assert next(stream) == "shown: Type a prompt first: the box is empty. Or pick a Spec-Bench question below it."
    with pytest.raises(app.gr.Error) as error:
        next(stream)
    assert error.value.message.startswith("Type a prompt first") and not error.value.visible  # no toast over the page


def test_answers_do_not_show_special_tokens(client, app_models):
    prompt = "What is 2+2? Answer with a number only."  # "2 + 2 = 4<|im_end|>"
    final = client.predict(prompt, 16, "small", 8, True, "", api_name="/live")
    assert "finished: the model ended its answer" in final[1]  # its last token is <|im_end|>
    assert "im_end" not in final[0] and "im_start" not in final[0]
    plain = app_models.get("").generate(prompt, 16, method="plain")
    assert visible_text(final[0]) == app_models.get("").tokenizer.decode(plain.token_ids, skip_special_tokens=True)


# A local model folder loads where the app allows it: tests/test_app_many_users.py


def test_app_py_is_layout_and_wiring():
    """Every handler is a short adapter: what a run does lives in ui.run, below the UI."""
    import ast

    tree = ast.parse((ROOT / "app.py").read_text())
    handlers = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Handlers")
    lengths = {f.name: f.end_lineno - f.lineno + 1 for f in handlers.body if isinstance(f, ast.FunctionDef)}
    assert {"live", "race", "replay", "stop", "view_step"} <= set(lengths)
    assert max(lengths.values()) <= 25, lengths
    assert "engine" not in (ROOT / "app.py").read_text(), "app.py asks runs and the model cache, never an engine"


def test_a_narrow_screen_gets_the_figures_compact_layout():
    """The page tells the session whether its screen is narrow (a phone); the step's figures follow it."""
    from visualize import matrix_figure, tree_figure

    session = Session()
    session.begin_live("", "exact", "hand", False).events.append(hand_event())
    handlers = app.Handlers(ModelCache(), TREES)
    wide = handlers.view_step(0, session)
    assert handlers.viewport(True, session) is session and session.narrow
    narrow = handlers.view_step(0, session)
    text = session.live.token_text
    assert narrow["draft_tree"].layout.title.text == tree_figure(hand_event(), text, compact=True).layout.title.text
    assert wide["draft_tree"].layout.title.text == tree_figure(hand_event(), text).layout.title.text
    assert narrow["matrix_rows"].layout.height == matrix_figure(hand_event(), text, compact=True).layout.height
    # the compact title wraps sooner
    assert narrow["draft_tree"].layout.title.text != wide["draft_tree"].layout.title.text
    assert handlers.viewport("yes", session).narrow is False  # anything but True is a wide screen


def test_every_output_of_the_api_has_a_name_a_programmer_reads(client):
    """No endpoint returns an output gradio could only call ``value_N``; /live and /race end with their JSON
    summaries, /step with the step's event."""
    endpoints = client.view_api(return_format="dict", print_info=False)["named_endpoints"]
    returns = {name: [r["label"] for r in e["returns"]] for name, e in endpoints.items()}
    assert not [(n, label) for n, labels in returns.items() for label in labels if re.fullmatch(r"value_\d+", label)]
    assert all(re.fullmatch(r"[a-z_]+", label) for labels in returns.values() for label in labels), returns
    assert returns["/live"][-1] == "run_summary" and returns["/race"][-1] == "race_summary"
    assert returns["/step"][-1] == "step_event" and returns["/trace"] == ["trace"]
    params = [p["parameter_name"] for p in endpoints["/race"]["parameters"]]
    assert params == ["prompt", "max_new_tokens", "tree", "top_k", "hot_start", "model_id", "mode", "race_methods",
                      "temperature", "top_p", "sample_top_k", "seed", "race_matrix"]


def test_the_readmes_race_helper_runs_against_the_app(served, capsys):
    """The README's gradio_client example, as written (with 8 tokens instead of 64, to keep the suite short)."""
    block = re.search(r"```python\n(from gradio_client import Client\n.*?)```", (ROOT / "README.md").read_text(),
                      re.S).group(1)
    code = block.replace("http://127.0.0.1:7860/", served)
    code = code.replace("max_new_tokens: int = 64", "max_new_tokens: int = 8")
    assert code.count(served) == 1 and "max_new_tokens: int = 8" in code
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in printed[:3]] == ["plain", "pld", "tr"]
    assert all(re.search(r"[\d.]+ tok/s  [\d.]+x  identical: True$", line) for line in printed[:3]), printed
    assert printed[3].startswith("Token Recycling ran at")


@pytest.mark.load  # a comparison of two timings on a shared CPU: with the load tests, not in the fast tier
def test_live_and_the_race_agree_on_one_speedup(client):
    """The same prompt and settings through Live and the race: one speedup definition, and Live's speedup (one run
    against plain decoding of the same length, timed after it; three such runs, their median, as the race reports
    the median of its three rounds) inside the races' range of rounds widened by 0.1 (issue 46). When Live
    interleaved plain decoding step by step it read 1.13-1.19x against a race of 1.22-1.23x here, and CI failed this
    check with a narrower margin (1.17x against 1.22-1.24x): the lanes changed each other's speed
    (ui.run.PlainAlongside). The host's speed drifts by up to 30% from one minute to the next, and a race measured
    after Live alone put Live's runs in one spell and the race in another (CI: 1.06x and 1.27x against 1.31-1.35x;
    in the browser, 1.35x and 1.22x against 1.03-1.13x). So one race runs before Live and one after, and the band is
    the range of all their rounds: the host's drift over Live's runs is inside it, a bias of Live's is not."""
    def race():
        return client.predict(PROMPT, 32, "small", 8, True, "", "exact", ["tr"], api_name="/race")[-1]

    races = [race()]
    lives = []
    for _ in range(3):
        client.predict(api_name="/reset")  # Live from the shipped hot start, as the race starts every method
        lives.append(client.predict(PROMPT, 32, "small", 8, True, "", "exact", "tr", api_name="/live")[
            LIVE["run_summary"]])
    races.append(race())
    assert all(live["speedup_definition"] == SPEEDUP_DEFINITION for live in lives)
    assert all(r["speedup_definition"] == SPEEDUP_DEFINITION for r in races)
    low = min(r["methods"]["tr"]["speedup_range"][0] for r in races)
    high = max(r["methods"]["tr"]["speedup_range"][1] for r in races)
    speedups = sorted(r["speedup"] for r in lives)
    median = speedups[1]
    print(f"live {median:.2f}x ({', '.join(f'{s:.2f}' for s in speedups)}); races "
          + ", ".join(f"{r['methods']['tr']['speedup']:.2f}x ({r['methods']['tr']['speedup_range'][0]:.2f}-"
                      f"{r['methods']['tr']['speedup_range'][1]:.2f})" for r in races))
    assert low - 0.1 <= median <= high + 0.1, (lives, [r["methods"]["tr"] for r in races])
    live = lives[1]
    assert all(live["tokens_per_forward_pass"] == r["methods"]["tr"]["tokens_per_forward_pass"] for r in races)
    assert live["matrix_history"] == "the shipped hot start, no run of yours yet"
    assert all(r["matrix_history"].startswith("the same matrix for every method") for r in races)


@pytest.fixture()
def recorded_trace(tiny_folder, tmp_path):
    """A trace written by the command line on "another machine" (here, with the tiny model)."""
    from tr_core.__main__ import main

    folder, _, _ = tiny_folder
    path = tmp_path / "run.json"
    assert main(["--method", "tr", "--prompt", "Name three colours.", "--model", str(folder), "--max-new-tokens",
                 "12", "--tree", "small", "--top-k", "4", "--trace", str(path)]) == 0
    return path


def test_a_trace_recorded_elsewhere_replays_with_its_own_speeds(recorded_trace, monkeypatch):
    import tr_core.trace_file as trace_file
    import ui.run

    monkeypatch.setattr(ui.run, "REPLAY_MAX_S", 0.2)
    events, meta = trace_file.read(recorded_trace)
    assert meta["machine"] and meta["method"] == "tr" and meta["identical_to_plain"] is True
    session = Session()
    replay = ui.run.TraceReplay(session, recorded_trace)
    snaps, counts = [], []
    for snap in replay.snapshots():
        snaps.append(snap)
        counts.append(len(snap.events))  # the record's own list grows: count it as it comes
    assert counts == list(range(1, len(events) + 1)) + [len(events)] and snaps[-1].done
    assert [e.to_dict() for e in session.live.events] == [e.to_dict() for e in events]  # every step, as recorded
    summary = session.live.summary
    assert summary["tokens_per_s"] == round(events[-1].rates.tokens_per_s, 3) == round(meta["tokens_per_s"], 3)
    assert summary["plain_tokens_per_s"] == meta["plain_tokens_per_s"]
    assert summary["speedup"] == pytest.approx(meta["speedup"], abs=1e-3)  # as measured there (rounded there)
    assert summary["recorded_on"].startswith(meta["machine"]) and "that machine's" in replay.note
    page = live_frame(snaps[-1], replay, True, session)
    assert visible_text(page["answer_html"]) == "".join(e.new_text for e in events)
    assert f"recorded on {meta['machine']}" in visible_text(page["counters_html"])


def test_a_file_that_is_not_a_trace_is_refused_with_one_sentence(tmp_path):
    import ui.run

    for content, message in [("not json", "is not JSON"), ('{"a": 1}', "is JSON but not a trace"),
                             ('{"format": "token-recycling-trace/1", "events": []}', "holds no decoding step"),
                             ('[{"step": 0, "method": "tr"}]', "a step event does not read")]:
        path = tmp_path / "bad.json"
        path.write_text(content)
        with pytest.raises(InputError, match=message):
            ui.run.TraceReplay(Session(), path)


def test_the_app_replays_an_uploaded_trace(client, recorded_trace):
    from gradio_client import handle_file

    final = client.predict(handle_file(str(recorded_trace)), api_name="/replay_trace")
    summary = final[LIVE["run_summary"]]
    assert summary["recorded_on"] and summary["method"] == "tr" and summary["speedup"] > 0
    assert "replaying a run recorded on" in final[LIVE["counters_html"]]
    assert client.predict(api_name="/trace")["live"]["events"][0]["step"] == 0  # the session's latest run now
    with pytest.raises(Exception, match="Pick a trace file first"):
        client.predict(None, api_name="/replay_trace")


def test_a_model_that_does_not_load_leaves_the_session_on_its_model():
    def load(model_id, config):
        raise ModelLoadError(f"could not load model id {model_id!r}: the hub (huggingface.co) cannot be reached")

    handlers, session = app.Handlers(ModelCache(load=load), TREES), Session(model_id="")
    shown = []
    with pytest.raises(app.gr.Error, match="cannot be reached"):
        for update in handlers.load_model("no-such-org/no-such-model", session):
            shown.append(update)
    assert shown[-1].startswith("**Not loaded.** could not load model id 'no-such-org/no-such-model'")
    assert shown[-1].endswith("Runs keep the embedded SmolLM2-135M-Instruct.")
    assert handlers.kept_model(session) == "" and session.model_id == ""  # the page's Model box goes back to it


def test_load_model_refuses_a_mode_it_does_not_have():
    handlers = app.Handlers(ModelCache(load=lambda model_id, config: None), TREES)
    with pytest.raises(app.gr.Error, match="The mode must be one of exact, fast; got 'turbo'"):
        list(handlers.load_model("", Session(model_id=""), "turbo"))


def test_empty_figures_and_the_history_fit_a_phone():
    """The placeholders' text comes in lines a 390 px screen shows whole; the history table scrolls sideways instead
    of being cut; past its last 50 lines the history says how many earlier runs it no longer lists."""
    from ui.frames import PLACEHOLDER_CHARS
    from ui.page import PROJECTION_PLACEHOLDER, RACE_PLACEHOLDER, TREE_PLACEHOLDER

    for text in (TREE_PLACEHOLDER, RACE_PLACEHOLDER, PROJECTION_PLACEHOLDER):
        lines = app.placeholder(text).layout.annotations[0].text.split("<br>")
        assert max(len(line) for line in lines) <= PLACEHOLDER_CHARS and " ".join(lines) == text
    session = Session()
    for _ in range(53):
        session.record("live", "small", 8, "shipped", Rates(10, 5, 1.0))
    assert len(session.history) == 50 and session.history[0]["run"] == 4 and session.history[-1]["run"] == 53
    page = history_html(session.history)
    assert page.startswith('<div class="tr-table-wrap">') and "and 3 earlier runs, no longer listed" in page


def test_the_default_mode_is_the_one_measured_faster_here(monkeypatch, tmp_path):
    """Both modes keep plain decoding's output; the page defaults to the one whose plain decoding measured faster
    (stubbed timings: exact 60 ms a token, fast 30), caches the measurement per machine and says why."""
    import ui.models as models_module

    def fake_load(model_id, config):
        step = 60.0 if config.mode == "exact" else 30.0
        events = [SimpleNamespace(forward_ms=step, overhead_ms=0.0)] * 4
        return SimpleNamespace(model=config.mode, generate=lambda *a, **k: SimpleNamespace(events=events))

    monkeypatch.setattr(models_module, "default_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(models_module, "machine_key", lambda model: "this-machine")
    # measured while other work used the cores: used by this process, not kept for the next start
    monkeypatch.setattr(models_module, "runnable_threads", lambda: 9)
    busy = ModelCache(load=fake_load)
    assert busy.measure_modes()[1].endswith("measured while other work used the cores: measured again at the next "
                                            "start")
    assert busy.default_mode()[0] == "fast" and not (tmp_path / "calibration").exists()
    monkeypatch.setattr(models_module, "runnable_threads", lambda: 1)  # a quiet machine from here on
    models = ModelCache(load=fake_load)
    assert models.default_mode() == ("exact", "the modes' speeds are not measured yet here")
    mode, why = models.measure_modes()
    assert mode == "fast"
    assert why == "plain decoding measured here at 30.0 ms a token in fast mode, 60.0 in exact (2.00x)"
    assert json.loads((tmp_path / "calibration" / "modes-this-machine.json").read_text()) == {"exact": 60.0,
                                                                                               "fast": 30.0}
    again = ModelCache(load=lambda *a: pytest.fail("a cached measurement is read, not measured again") if a[1].mode
                       == "fast" else fake_load(*a))
    assert again.measure_modes() == (mode, why) and again.default_mode() == (mode, why)
    radios = app.Handlers(models, TREES).default_mode()
    assert [r.value for r in radios] == ["fast", "fast"] and radios[0].info.startswith("default here: fast, plain")
    # a later start builds the page with the mode an earlier one measured, before any model is loaded: a Run
    # clicked before the page's load event ran decodes in it too
    fresh = ModelCache(load=lambda *a: pytest.fail("the page is built without loading a model"))
    assert fresh.default_mode() == (mode, why)
    demo = app.build_app(fresh)
    radios = [b for b in demo.blocks.values() if type(b).__name__ == "Radio" and b.label.startswith("Mode")]
    assert len(radios) == 2 and all(r.value == "fast" and r.info == f"default here: fast, {why}" for r in radios)


def test_a_run_hands_its_freed_memory_back_when_it_ends(monkeypatch):
    """``Handlers._stoppable`` releases the heap's free pages once the run is over (and only then), also when the run
    fails; the memory test (test_app_many_users) measures the RSS this keeps steady."""
    released = []
    monkeypatch.setattr(app, "release_freed_memory", lambda: released.append(True) or True)
    handlers = app.Handlers(ModelCache(), TREES)
    request = SimpleNamespace(session_hash="s1")
    with handlers._stoppable(request, object()):
        assert released == [] and "s1" in handlers.running
    assert released == [True] and "s1" not in handlers.running
    with pytest.raises(RuntimeError), handlers._stoppable(request, object()):
        raise RuntimeError("the run failed")
    assert released == [True, True]


def test_live_and_the_race_decode_on_the_torch_backend_where_the_setting_says_so(tiny_folder, monkeypatch):
    # issue 53: TR_BACKEND=torch makes the app decode on the torch backend (a GPU's path), here on the CPU; the
    # session's matrix follows the model's device and comes back to the CPU for the session's record
    import copy

    from ui.models import BACKEND_SETTING

    _, model, tokenizer = tiny_folder
    model = copy.deepcopy(model)  # the torch backend sets the model's attention implementation
    monkeypatch.setenv(BACKEND_SETTING, "torch")
    models = ModelCache(load=lambda model_id, config: Engine(model, tokenizer, config))
    session = Session()
    live = LiveRun(session, models, settings(sampling=(0.8, 0.95, 0, 3)))
    live.prepare()
    assert live.engine.backend.name == "torch" and live.engine.matrix.device == model.device
    snaps = list(live.snapshots())
    assert snaps[-1].done and snaps[-1].baseline.identical is True  # plain decoding's very tokens
    assert session.matrix_delta is not None and len(session.matrix_delta.index) > 0
    race = Race(session, models, settings(race=("pld", "tr", "tr-context")))
    race.prepare()
    assert race.engine.backend.name == "torch"
    assert list(race.progress())[-1].done
    plain = session.race.rounds["plain"][0].token_ids
    assert len(plain) == 12 and all(run.token_ids == plain for runs in session.race.rounds.values() for run in runs)
    monkeypatch.setenv(BACKEND_SETTING, "cuda")
    with pytest.raises(ValueError, match="TR_BACKEND='cuda': choose one of auto, native, torch"):
        ModelCache()


def test_the_sessions_matrix_follows_the_models_device_and_its_record_stays_on_the_cpu(tiny_models):
    # the rule a run on a GPU keeps, read on the CPU with a device torch can make anywhere ("meta"): the working copy
    # a run drafts from is on the engine's model's device; the shared start and the session's delta stay on the CPU
    engine = tiny_models.get("")
    elsewhere = SimpleNamespace(model=SimpleNamespace(device=torch.device("meta"), config=engine.model.config),
                                vocab_size=engine.vocab_size, config=engine.config)
    session = Session()
    for hot in (True, False):
        matrix, _ = session.matrix_for(elsewhere, "", hot)
        assert matrix.device.type == "meta"
    taught = AdjacencyMatrix(engine.vocab_size, engine.config.top_k)
    taught.update(torch.tensor([5, 6]), torch.arange(16).view(2, 8))
    session.matrix_for(engine, "", True)
    session.keep_matrix(taught)
    assert session.matrix_base.device.type == "cpu" and session.matrix_delta.index.tolist() == [5, 6]
    with pytest.raises(ValueError, match="the matrix is on meta, the model on cpu: pass matrix.to"):
        engine.with_matrix(taught.to("meta"))
