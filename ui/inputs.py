"""What the app accepts from a user, checked in one place: every control's value, the prompt's text, the prompt's
length against the model's context, and what the Model box may name.

Every check raises ``InputError`` with a sentence a user can act on; the app turns it into a message on the page
(and an error through the API). Nothing here knows gradio.

    check_number(300, "Max new tokens", MAX_NEW_TOKENS)     # InputError: Max new tokens must be a whole number
                                                            #   from 1 to 256; got 300.
    clean_prompt("Hi\\x00 there\\x1b").text                  # "Hi there"
    check_model_id("/etc", allow_local=False)               # InputError: This app does not load models from
                                                            #   folders on the server...

The context policy (``prompt_ids``): the app reads at most ``MAX_PROMPT_TOKENS`` prompt tokens, and never more than
the model's context minus max new tokens; a longer prompt loses its beginning (the chat template around it is kept),
and the note returned says so, for the status line.
"""

from __future__ import annotations

import math
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from tr_core.models import encode_prompt

MAX_NEW_TOKENS = (1, 256)  # (lowest, highest) accepted, by the API and by the page alike
TOP_K = (1, 16)
TEMPERATURE = (0.0, 2.0)  # 0: greedy
TOP_P = (0.01, 1.0)  # 1: no top-p filter
SAMPLE_TOP_K = (0, 1000)  # 0: no top-k filter (not the matrix's k)
SEED = (0, 2 ** 31 - 1)
# A prompt's prefill holds the one model slot of the server: on a small CPU, 2,048 tokens take a few seconds.
MAX_PROMPT_TOKENS = 2048
# Text beyond this many characters from the end is dropped before tokenizing (it could not fit in MAX_PROMPT_TOKENS
# tokens of a usual tokenizer anyway), so that a huge paste costs no tokenizer time.
MAX_PROMPT_CHARS = 16 * MAX_PROMPT_TOKENS
MAX_MODEL_ID_CHARS = 200
# A Hugging Face hub id: "name" or "owner/name"; letters, digits, '-', '_', '.'.
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")
KEPT_CONTROLS = {"\n", "\t"}
# A web address of a model page on the hub: its path starts with the hub id ("owner/name"), then maybe "/tree/main"
HUB_URL = re.compile(r"(?:https?://)?(?:www\.)?(?:huggingface\.co|hf\.co)/(?P<path>[^?#]*)(?:[?#].*)?", re.IGNORECASE)
WEB_ADDRESS = re.compile(r"[a-z][a-z0-9+.-]*://", re.IGNORECASE)


class InputError(ValueError):
    """A value the app does not accept; the message says which, why, and what is accepted."""


def check_number(value, name: str, bounds: tuple[int, int]) -> int:
    """``value`` as an int if it is a whole number within ``bounds`` (``64`` and ``64.0`` pass; ``True``, ``"64"``,
    ``nan`` and ``3.5`` do not)."""
    low, high = bounds
    rule = f"{name} must be a whole number from {low} to {high}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{rule}; got {_shown(value)}.")
    if not math.isfinite(value) or value != int(value) or not low <= value <= high:
        raise InputError(f"{rule}; got {_shown(value)}.")
    return int(value)


def check_real(value, name: str, bounds: tuple[float, float]) -> float:
    """``value`` as a float if it is a finite number within ``bounds`` (``True``, ``"0.7"`` and ``nan`` do not
    pass)."""
    low, high = bounds
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not low <= value <= high):
        raise InputError(f"{name} must be a number from {low:g} to {high:g}; got {_shown(value)}.")
    return float(value)


def check_flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"{name} must be true or false; got {_shown(value)}.")
    return value


def check_choice(value, name: str, choices: list[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise InputError(f"Unknown {name} {_shown(value)}: choose one of {', '.join(choices)}.")
    return value


def check_step(value, steps: int) -> int:
    """A step index of a run with ``steps`` steps."""
    return check_number(value, f"The step (this run has {steps}, numbered from 0)", (0, steps - 1))


@dataclass(frozen=True)
class Prompt:
    """A prompt cleaned for the model: its text, what was removed from it, and whether its beginning was dropped
    (``MAX_PROMPT_CHARS``)."""

    text: str
    removed: str = ""  # e.g. "2 control characters removed"
    cut: bool = False


def clean_prompt(text) -> Prompt:
    """The prompt a model may read.

    Only the last ``MAX_PROMPT_CHARS`` characters are kept. Control characters other than newline and tab are
    removed (``\\r\\n`` becomes ``\\n``); a lone surrogate (which no tokenizer can encode) becomes U+FFFD. Emoji, other
    scripts, combining marks and zero-width joiners stay. Raises ``InputError`` when no text is left.

    >>> clean_prompt("Hi\\x00 there\\x1b")
    Prompt(text='Hi there', removed='2 control characters removed', cut=False)
    """
    if text is None:
        text = ""
    if not isinstance(text, str):
        raise InputError(f"The prompt must be text; got {_shown(text)}.")
    cut = len(text) > MAX_PROMPT_CHARS
    text = text[-MAX_PROMPT_CHARS:].replace("\r\n", "\n")
    kept, controls, surrogates = [], 0, 0
    for ch in text:
        kind = unicodedata.category(ch)
        if kind == "Cc" and ch not in KEPT_CONTROLS:
            controls += 1
        elif kind == "Cs":
            surrogates += 1
            kept.append("\ufffd")
        else:
            kept.append(ch)
    cleaned = "".join(kept)
    if not cleaned.strip():
        what = "holds only spaces or invisible characters" if text else "is empty"
        raise InputError(f"Type a prompt first: the box {what}. Or pick a Spec-Bench question below it.")
    notes = []
    if controls:
        notes.append(f"{controls} control character{'s' * (controls != 1)} removed")
    if surrogates:
        notes.append(f"{surrogates} unpaired surrogate{'s' * (surrogates != 1)} replaced by \ufffd")
    return Prompt(cleaned, ", ".join(notes), cut)


def prompt_limit(context: int | None, max_new_tokens: int) -> int:
    """The most prompt tokens a run reads: ``MAX_PROMPT_TOKENS``, and room for ``max_new_tokens`` in the model's
    context (one position more: the decoder keeps the last token out of its cache)."""
    if context is None:
        return MAX_PROMPT_TOKENS
    return min(MAX_PROMPT_TOKENS, context - max_new_tokens - 1)


def prompt_ids(tokenizer, prompt: Prompt, max_new_tokens: int, context: int | None) -> tuple[list[int], str]:
    """Token ids of ``prompt`` as the model reads it (in its chat template, if any), cut from the left to the context
    policy, and a note for the status line saying what was removed or dropped (``""`` if nothing).

    The cut happens in the user's text, not in the template: the chat markup before and after it stays whole.
    """
    limit = prompt_limit(context, max_new_tokens)
    text, cut = prompt.text, prompt.cut
    ids = encode_prompt(tokenizer, text)
    if len(ids) > limit:
        body = tokenizer(text, add_special_tokens=False)["input_ids"]
        keep = limit - (len(ids) - len(body))  # the chat template's tokens around the text stay
        while True:
            if keep < 1:
                raise InputError(f"This model's context ({context} tokens) leaves no room for a prompt with max new "
                                 f"tokens {max_new_tokens}: lower max new tokens.")
            text = tokenizer.decode(body[-keep:]).lstrip("\ufffd")  # a character cut in half is dropped
            ids = encode_prompt(tokenizer, text)
            if len(ids) <= limit:
                break
            keep -= len(ids) - limit  # the cut text can tokenize into a few more tokens
        cut = True
    notes = [prompt.removed] if prompt.removed else []
    if cut:
        reads = f"{limit:,} tokens" + (f" with max new tokens {max_new_tokens}" if limit < MAX_PROMPT_TOKENS else "")
        notes.append(f"the prompt is longer than this app reads ({reads}): its beginning was dropped and the model "
                     f"reads its last {len(ids):,} tokens")
    return ids, "; ".join(notes)


def looks_like_a_path(text: str) -> bool:
    """Whether the Model box names something on the server's disk rather than a hub id. transformers reads an
    existing folder of that name first, so ``"assets"`` counts as a path where such a folder exists."""
    if text.startswith(("/", ".", "~")) or "\\" in text or text.count("/") > 1:
        return True
    try:
        return Path(text).expanduser().exists()
    except (OSError, ValueError):
        return False


def check_model_id(value, allow_local: bool) -> str:
    """The Model box's value, stripped: ``""`` (the embedded model), a hub id, or (only where the app was started
    with ``--allow-local-models``) a folder on the server."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InputError(f"The model must be a hub id such as 'HuggingFaceTB/SmolLM2-135M-Instruct'; got "
                         f"{_shown(value)}.")
    text = value.strip()
    if not text:
        return ""
    if len(text) > MAX_MODEL_ID_CHARS:
        raise InputError(f"A model id has at most {MAX_MODEL_ID_CHARS} characters; this one has {len(text):,}.")
    if not text.isprintable():
        raise InputError(f"{_shown(text)} is not a hub id: it holds control or invisible characters.")
    text = hub_id_of_address(text)
    if looks_like_a_path(text):
        if allow_local:
            return text
        raise InputError(f"This app does not load models from folders on the server ({_shown(text)}): give a "
                         "hub id such as 'HuggingFaceTB/SmolLM2-135M-Instruct'. Whoever runs the app can allow "
                         "folders by starting it with --allow-local-models.")
    if not HUB_ID.fullmatch(text) or ".." in text or "--" in text:
        raise InputError(f"{_shown(text)} is not a hub id: a hub id is 'name' or 'owner/name', of letters, digits, "
                         "'-', '_' and '.'.")
    return text


def hub_id_of_address(text: str) -> str:
    """The hub id in a model page's web address (``text`` itself if it is no web address); ``InputError`` for a web
    address elsewhere, or one that names no model.

    >>> hub_id_of_address("https://huggingface.co/HuggingFaceTB/SmolLM2-135M/tree/main")
    'HuggingFaceTB/SmolLM2-135M'
    >>> hub_id_of_address("gpt2")
    'gpt2'
    """
    page = HUB_URL.fullmatch(text)
    if page is None:
        if WEB_ADDRESS.match(text):
            raise InputError(f"{_shown(text)} is a web address: paste the model's hub id, 'owner/name' (for example "
                             "HuggingFaceTB/SmolLM2-135M-Instruct).")
        return text
    parts = [p for p in page["path"].split("/") if p]
    if parts[:1] in (["models"], ["spaces"], ["datasets"]) or not parts:
        raise InputError(f"{_shown(text)} names no model: paste the model's hub id, 'owner/name' (for example "
                         "HuggingFaceTB/SmolLM2-135M-Instruct).")
    return "/".join(parts[:2]) if len(parts) > 1 and parts[1] not in ("tree", "blob", "resolve") else parts[0]


def _shown(value) -> str:
    """A value as a message quotes it: short, and printable whatever it holds."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "…"
