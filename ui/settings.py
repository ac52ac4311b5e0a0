"""A run's settings, as the page's controls give them, each checked (``ui.inputs``), and the draft trees a user may
pick.

    settings = Settings.check(prompt=prompt, max_new_tokens=64, tree="small", top_k=8, hot_start=True, model_id="",
                              mode="exact", trees=tree_names())
    settings.max_new_tokens                     # 64
    settings.method, settings.race_methods      # "tr", ("pld", "tr", ...): Live's method, the race's beside plain
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tr_core.assets import TREES_DIR
from tr_core.backend import MODES
from tr_core.engine import AUTO
from tr_core.methods import APP_NAMES, METHODS
from tr_core.sampling import Sampling
from tr_core.tree import BUILTIN_TEMPLATES, TreeTemplateError, load_template

from .inputs import (
    MAX_NEW_TOKENS,
    SAMPLE_TOP_K,
    SEED,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    InputError,
    Prompt,
    check_choice,
    check_flag,
    check_model_id,
    check_number,
    check_real,
    clean_prompt,
)


@dataclass(frozen=True)
class Settings:
    """One run's settings, every one checked. ``model_id`` ``""`` is the embedded model."""

    prompt: Prompt
    max_new_tokens: int
    tree: str
    top_k: int
    hot_start: bool
    model_id: str
    mode: str
    method: str = "tr"  # what Live decodes with
    race_methods: tuple[str, ...] = ()  # what the race measures beside plain decoding
    sampling: Sampling = Sampling()  # greedy unless a temperature is set

    race_matrix: str = "shipped"  # what the race's every method starts from: RACE_MATRICES

    @classmethod
    def check(cls, *, prompt, max_new_tokens, tree, top_k, hot_start, model_id, mode, method="tr", race_methods=None,
              race_matrix="shipped", temperature=0.0, top_p=1.0, sample_top_k=0, seed=0, trees: list[str],
              allow_local_models: bool = False) -> "Settings":
        """The settings a request brings, by name as the page's controls and the API call them; ``InputError``
        names the first that is refused."""
        return cls(clean_prompt(prompt), check_number(max_new_tokens, "Max new tokens", MAX_NEW_TOKENS),
                   check_choice(tree, "draft tree", trees), check_number(top_k, "k: candidates per row", TOP_K),
                   check_flag(hot_start, "Hot start"), check_model_id(model_id, allow_local_models),
                   check_choice(mode, "mode", list(MODES)), check_choice(method, "method", list(APP_NAMES)),
                   check_race_methods(DEFAULT_RACE if race_methods is None else race_methods),
                   check_sampling(temperature, top_p, sample_top_k, seed),
                   check_choice(race_matrix, "race matrix", list(RACE_MATRICES)))


def check_sampling(temperature, top_p, sample_top_k, seed) -> Sampling:
    """The sampling the page's controls set: temperature 0 is greedy (and then the rest is unused)."""
    return Sampling(check_real(temperature, "Temperature", TEMPERATURE),
                    check_real(top_p, "Top-p", TOP_P),
                    check_number(sample_top_k, "Sampling top-k (0 = no filter)", SAMPLE_TOP_K),
                    check_number(seed, "Seed", SEED))


# The race's methods beside plain decoding, by default: the baseline users know, the paper's method, and the best
# extension beyond the paper as this project's benchmark measured it (README)
DEFAULT_RACE = ("pld", "tr", "tr-context")
RACE_CHOICES = tuple(n for n in APP_NAMES if n != "plain")
# What every matrix method of a race starts from: by default the same shipped hot start for each (so that a race
# measures the method, not what this session's runs taught the matrix); optionally a copy of the session's matrix
RACE_MATRICES = {"shipped": "the shipped hot start, the same for every method",
                 "session": "a copy of your session's matrix (what your live runs taught it)"}


def check_race_methods(value) -> tuple[str, ...]:
    """The race's methods beside plain decoding, in the registry's order: at least one, each known."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise InputError(f"The race's methods must be a list of names from {', '.join(RACE_CHOICES)}.")
    for name in value:
        check_choice(name, "race method", list(RACE_CHOICES))
    if not value:
        raise InputError("Pick at least one method to race against plain decoding.")
    return tuple(n for n in RACE_CHOICES if n in value)


# The methods beyond the paper missed this project's targets on its benchmark (README): experiments, said so
BEYOND = " (beyond the paper, an experiment)"


def tree_picker_note(method: str) -> str | None:
    """Why Live's Draft tree picker does nothing while ``method`` is picked (``None``: it drafts with the tree picked).

    >>> tree_picker_note("tr") is None, tree_picker_note("tr-context")[:40]
    (True, 'Token Recycling + context sizes its own ')
    """
    m = METHODS.get(method)
    if m is None or method == "tr":
        return None
    if m.beyond_paper:
        return f"{m.label} sizes its own tree on this machine; the tree picked applies to Token Recycling only."
    return f"{m.label} drafts without the matrix's tree; the tree picked applies to Token Recycling only."


def method_choices(names=APP_NAMES) -> list[tuple[str, str]]:
    """``[(label, name), ...]`` for the method pickers; the methods beyond the paper say so."""
    return [(METHODS[n].label + (BEYOND if METHODS[n].beyond_paper else ""), n) for n in names]


def methods_help(names=APP_NAMES) -> str:
    """One line per method, in Markdown: its name, whether it goes beyond the paper, and what it adds."""
    return "\n".join(f"- **{label}**: {METHODS[n].about}" for label, n in method_choices(names))


def tree_names(dirs: tuple[Path, ...] = (TREES_DIR,)) -> list[str]:
    """Every tree a user can pick: the tree fitted to the model and machine (``auto``), the built-in templates, and
    each ``<name>.json`` in ``dirs``."""
    extra = sorted({p.stem for d in dirs for p in Path(d).glob("*.json")} - set(BUILTIN_TEMPLATES) - {AUTO})
    return [AUTO] + list(BUILTIN_TEMPLATES) + extra


def tree_choices(dirs: tuple[Path, ...] = (TREES_DIR,)) -> list[tuple[str, str]]:
    """``[(label, name), ...]`` for a dropdown, e.g. ``("paper: the paper's tree, 80 draft nodes", "paper")``; a
    tree file that does not load is left out. The fitted tree's size is known once the model is loaded."""
    choices = [(f"{AUTO}: fitted to the model and this machine", AUTO)]
    for name in tree_names(dirs)[1:]:
        try:
            size = load_template(name, dirs).size - 1
        except TreeTemplateError:
            continue
        choices.append((f"{name}: {'the paper' + chr(39) + 's tree, ' if name == 'paper' else ''}{size} draft nodes",
                        name))
    return choices
