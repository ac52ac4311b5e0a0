"""Tokens that are not whole UTF-8 text (a byte-level BPE's bytes: parts of an emoji) show as their bytes, e.g.
⟨F0 9F⟩, never as U+FFFD, the replacement character decoding gives them: in the tree, the matrix and the answer."""

from __future__ import annotations

import json

import pytest
from test_app import settings

from tr_core.text import TokenText, shown_piece, token_bytes
from ui.frames import live_frame
from ui.run import LiveRun
from ui.session import Session

EMOJI_PROMPT = "Reply with three emoji only, like this: 🚲🚲🚲"


@pytest.fixture(scope="module")
def tokenizer(app_models):
    return app_models.get("").tokenizer


def test_the_embedded_tokenizers_byte_tokens_show_as_their_bytes(tokenizer):
    assert tokenizer.decode([117]) == "\ufffd" and tokenizer.decode([127]) == "\ufffd"  # what decoding gives
    assert token_bytes(tokenizer, 117) == b"\xa7" and token_bytes(tokenizer, 127) == b"\xb2"
    assert TokenText(tokenizer).pieces([117, 127]) == ["⟨A7⟩", "⟨B2⟩"]
    bicycle = tokenizer(" 🚲")["input_ids"]  # the emoji's four bytes F0 9F 9A B2, split over tokens
    shown = [shown_piece(tokenizer, t, tokenizer.decode([t])) for t in bicycle]
    assert "".join(shown).replace("⟨", " ").replace("⟩", " ").split() == ["F0", "9F", "9A", "B2"], shown
    assert shown[0].startswith(" ⟨")  # the whole characters around the bytes stay text
    whole = tokenizer(" bicycle é")["input_ids"]
    assert [shown_piece(tokenizer, t, tokenizer.decode([t])) for t in whole] == \
        [tokenizer.decode([t]) for t in whole]  # whole text: unchanged


def test_no_figure_of_an_emoji_prompts_run_holds_the_replacement_character(app_models):
    session = Session()
    run = LiveRun(session, app_models, settings(max_new_tokens=24, prompt=EMOJI_PROMPT))
    run.prepare()
    frames = [live_frame(snap, run, True, session) for snap in run.snapshots()]
    named = [t for e in session.live.events for t in e.tree_tokens]
    assert any(token_bytes(app_models.get("").tokenizer, t) is not None and
               "\ufffd" in app_models.get("").tokenizer.decode([t]) for t in named), "the run drafted no byte token"
    for frame in frames:
        for name in ("draft_tree", "matrix_rows", "answer_html"):
            if name in frame:
                value = frame[name]
                text = value if isinstance(value, str) else json.dumps(value.to_plotly_json(), ensure_ascii=False)
                assert "\ufffd" not in text, name
