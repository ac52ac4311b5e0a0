"""What the app accepts (ui.inputs) and how a failed request ends (ui.errors), without launching the app."""

from __future__ import annotations

import math

import pytest
from conftest import ROOT

from tr_core.models import embedded_model_folder, encode_prompt
from ui.inputs import (
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKENS,
    InputError,
    Prompt,
    check_model_id,
    check_number,
    check_step,
    clean_prompt,
    prompt_ids,
    prompt_limit,
)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model_folder())


def test_numbers_must_be_whole_and_in_range():
    assert check_number(64, "Max new tokens", (1, 256)) == 64
    assert check_number(64.0, "Max new tokens", (1, 256)) == 64
    for bad in (0, 257, -1, 3.5, math.nan, math.inf, -math.inf, True, "64", None, [64], 10 ** 30):
        with pytest.raises(InputError, match=r"^Max new tokens must be a whole number from 1 to 256; got "):
            check_number(bad, "Max new tokens", (1, 256))
    with pytest.raises(InputError, match=r"^The step \(this run has 3, numbered from 0\) must be a whole number "
                                         r"from 0 to 2; got 3\.$"):
        check_step(3, 3)


def test_the_prompt_keeps_text_and_loses_control_characters():
    assert clean_prompt("Explain 🚲, 自行车 and ñ̃ 👨‍👩‍👧\n\tplease") == \
        Prompt("Explain 🚲, 自行车 and ñ̃ 👨‍👩‍👧\n\tplease", "", False)
    assert clean_prompt("a\x00b\x1b[31mc\r\nd\x7f") == Prompt("ab[31mc\nd", "3 control characters removed", False)
    assert clean_prompt("x\ud800y") == Prompt("x\ufffdy", "1 unpaired surrogate replaced by \ufffd", False)
    for empty, what in [("", "is empty"), (None, "is empty"), ("  \n\t", "holds only spaces or invisible characters"),
                        ("\x00\x01", "holds only spaces or invisible characters")]:
        with pytest.raises(InputError) as refused:
            clean_prompt(empty)
        assert str(refused.value) == f"Type a prompt first: the box {what}. Or pick a Spec-Bench question below it."
    with pytest.raises(InputError, match="The prompt must be text; got 42."):
        clean_prompt(42)
    long = clean_prompt("a" * 10 + "b" * MAX_PROMPT_CHARS)
    assert long.cut and long.text == "b" * MAX_PROMPT_CHARS


def test_a_short_prompt_is_read_whole(tokenizer):
    ids, note = prompt_ids(tokenizer, clean_prompt("Name three colours."), 64, 8192)
    assert ids == encode_prompt(tokenizer, "Name three colours.") and note == ""


def test_a_long_prompt_loses_its_beginning_and_keeps_the_chat_template(tokenizer):
    text = " ".join(f"w{i}" for i in range(400))
    ids, note = prompt_ids(tokenizer, clean_prompt(text), 16, 200)
    assert prompt_limit(200, 16) == 183 and 175 <= len(ids) <= 183
    # the chat markup before and after the text is whole; the text is its own end
    template = encode_prompt(tokenizer, "")
    assert ids[:3] == template[:3] and ids[-5:] == template[-5:]
    kept = tokenizer.decode(ids)
    assert "w399" in kept and " w0 " not in kept
    assert note == ("the prompt is longer than this app reads (183 tokens with max new tokens 16): its beginning "
                    f"was dropped and the model reads its last {len(ids)} tokens")
    # the app's own bound, on a long-context model
    ids, note = prompt_ids(tokenizer, clean_prompt("word " * 20_000), 64, 8192)
    assert len(ids) <= MAX_PROMPT_TOKENS and note.startswith(
        f"the prompt is longer than this app reads ({MAX_PROMPT_TOKENS:,} tokens): its beginning was dropped")
    # a context with no room left for a prompt
    with pytest.raises(InputError, match=r"This model's context \(64 tokens\) leaves no room for a prompt with max "
                                         r"new tokens 60: lower max new tokens\."):
        prompt_ids(tokenizer, clean_prompt(text), 60, 64)


def test_the_model_box_takes_hub_ids_and_folders_only_where_allowed(tmp_path):
    assert check_model_id(None, False) == "" and check_model_id("  ", False) == ""
    assert check_model_id(" HuggingFaceTB/SmolLM2-135M-Instruct ", False) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert check_model_id("gpt2", False) == "gpt2"
    for folder in ("/etc", "../x", "./x", "~/models", "a/b/c", "C:\\models", str(tmp_path), str(ROOT / "assets")):
        with pytest.raises(InputError, match="This app does not load models from folders on the server"):
            check_model_id(folder, False)
        assert check_model_id(folder, True) == folder
    # a model page's web address is understood as its hub id; another web address is refused with what to paste
    for url in ("https://huggingface.co/HuggingFaceTB/SmolLM2-135M", "huggingface.co/HuggingFaceTB/SmolLM2-135M/",
                "https://hf.co/HuggingFaceTB/SmolLM2-135M/tree/main", " http://www.huggingface.co/HuggingFaceTB/SmolLM2-135M?x=1"):
        assert check_model_id(url, False) == "HuggingFaceTB/SmolLM2-135M"
    assert check_model_id("https://huggingface.co/gpt2/blob/main/config.json", False) == "gpt2"
    for url, message in [("https://example.com/org/model", "is a web address: paste the model's hub id, 'owner/name'"),
                         ("https://huggingface.co/datasets/org/data", "names no model: paste the model's hub id"),
                         ("https://huggingface.co/", "names no model")]:
        with pytest.raises(InputError, match=message):
            check_model_id(url, True)  # never taken for a folder, even where folders are allowed
    for bad, message in [("not a model!", "is not a hub id"), ("org/a..b", "is not a hub id"),
                         ("org/a--b", "is not a hub id"), ("x\x00y", "control or invisible characters"),
                         ("x" * 201, "at most 200 characters"), (7, "The model must be a hub id")]:
        with pytest.raises(InputError, match=message):
            check_model_id(bad, False)


def test_a_failure_ends_as_one_message():
    import gradio as gr

    from tr_core.models import ModelLoadError
    from ui.errors import user_errors

    @user_errors
    def steps(error):
        yield 1
        raise error

    @user_errors
    def call(error):
        raise error

    for fn in (lambda e: list(steps(e)), call):
        with pytest.raises(gr.Error) as expected:
            fn(ModelLoadError("could not load model id x"))
        assert expected.value.message == "could not load model id x"
        with pytest.raises(gr.Error) as fault:
            fn(KeyError("/secret/path"))
        assert fault.value.message == ("The server could not finish this request (KeyError). The app keeps serving: "
                                       "try again, or with other settings.")
