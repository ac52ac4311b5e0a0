"""Saved traces and token text: everything a figure needs to name a token, without a tokenizer.

A trace is a JSON list of ``StepEvent.to_dict()``. Events carry the text of their tree tokens (``tree_text``) and of
the tokens they produced (``new_text``), so a trace alone can label most cells; ids it never decoded fall back to
``"#<id>"``. A caller that has the tokenizer passes its own ``token_text`` and every id is named.

    events = load_trace("tests/fixtures/trace_small.json")
    text = text_lookup(events)          # id -> str, from the trace
    label(text(198))                    # '↵'
"""

from __future__ import annotations

import json
from functools import lru_cache
from html import escape
from pathlib import Path
from typing import Callable, Iterable

from tr_core.events import StepEvent  # plain dataclasses: no torch

TokenNamer = Callable[[int], str]  # a token id's text: a tokenizer's decode, or text_lookup(events)

# Whitespace a reader could not see in a label, and the sign drawn for it. (A carriage return gets '⇤', not '␍',
# which common fonts such as DejaVu lack.)
VISIBLE = str.maketrans({" ": "␣", "\n": "↵", "\t": "⇥", "\r": "⇤"})
LABEL_CHARS = 10  # longest label drawn on a node or a cell; the hover text has the whole token


def load_trace(path: str | Path) -> list[StepEvent]:
    """Read a JSON trace (a list of event dicts, or the command line's ``{"meta": ..., "events": [...]}``) into
    ``StepEvent`` objects, in step order."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return [StepEvent.from_dict(d) for d in (data["events"] if isinstance(data, dict) else data)]


def token_text_map(events: Iterable[StepEvent]) -> dict[int, str]:
    """``{token id: text}`` for every id a trace decoded.

    Tree tokens come with their text. A step's bonus token is not a tree node, but its text is what ``new_text``
    holds after the accepted draft tokens: ``new_text = ' marvel of engineering.'`` with accepted drafts
    ``' marvel', ' of', ' engineering'`` gives the bonus ``'.'``. (It is also the next step's root.)
    """
    known: dict[int, str] = {}
    for e in events:
        known.update(zip(e.tree_tokens, e.tree_text))
    for e in events:
        drafted = [e.tree_tokens[i] for i in e.accepted_path[1:]]
        if e.new_tokens != drafted + [e.bonus_token] or e.bonus_token in known:
            continue  # cut at EOS or the token budget, or already named
        prefix = "".join(known[t] for t in drafted)
        if e.new_text.startswith(prefix):
            known[e.bonus_token] = e.new_text[len(prefix):]
    return known


def text_lookup(events: Iterable[StepEvent], token_text: TokenNamer | None = None) -> TokenNamer:
    """An ``id -> text`` function: the caller's ``token_text`` if given, else the trace's own, ``"#<id>"`` when
    unknown. Lookups are cached, since a figure names the same tokens many times."""
    if token_text is not None:
        cache: dict[int, str] = {}

        def cached(token: int) -> str:
            if token not in cache:
                cache[token] = token_text(token)
            return cache[token]

        return cached
    known = token_text_map(events)
    return lambda token: known.get(token, f"#{token}")


def visible(text: str) -> str:
    """Show whitespace: ``' a\\n\\t\\r'`` -> ``'␣a↵⇥⇤'``."""
    return text.translate(VISIBLE)


@lru_cache(maxsize=65536)
def label(text: str, max_chars: int = LABEL_CHARS) -> str:
    """A token as a figure draws it: whitespace visible, cut to ``max_chars`` signs, HTML-escaped (plotly reads
    tags in text). ``label(' engineering')`` -> ``'␣engineer…'``; ``label('<|im_end|>')`` -> ``'&lt;|im_end|&gt;'``.
    """
    shown = visible(text)
    if len(shown) > max_chars:
        shown = shown[: max_chars - 1] + "…"
    return escape(shown, quote=False)


@lru_cache(maxsize=65536)
def quoted(text: str) -> str:
    """A token for hover text: whitespace visible, HTML-escaped (plotly reads tags) so ``<|im_end|>`` stays text:
    ``quoted('<|im_end|>')`` -> ``"'&lt;|im_end|&gt;'"``."""
    return "'" + escape(visible(text), quote=False) + "'"
