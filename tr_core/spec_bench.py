"""Spec-Bench questions (480, six categories): the standard prompts of the benchmark.

The project keeps its own copy in ``assets/spec_bench/`` (Apache-2.0, attribution in its README). Any JSON-lines
file of the same shape works: ``{"question_id", "category", "turns": [first user turn, ...]}``; only the first turn
is used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .assets import SPEC_BENCH_QUESTIONS

# Spec-Bench reports the eight MT-bench sub-categories together as one "multi-turn conversation" category.
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


@dataclass(frozen=True)
class Question:
    question_id: int
    category: str  # one of CATEGORIES for Spec-Bench; the file's own category otherwise
    prompt: str


def load_questions(path: str | Path | None = None) -> list[Question]:
    path = Path(path) if path else SPEC_BENCH_QUESTIONS
    questions = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ValueError(f"cannot read questions from {path}: {e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            category = "mt_bench" if row["category"] in MT_BENCH else str(row["category"])
            questions.append(Question(int(row["question_id"]), category, str(row["turns"][0])))
        except (json.JSONDecodeError, KeyError, IndexError, TypeError, ValueError) as e:
            raise ValueError(f"{path}:{n}: not a Spec-Bench question line ({e})") from None
    if not questions:
        raise ValueError(f"{path}: no questions")
    return questions


def stratified(questions: list[Question], per_category: int) -> list[Question]:
    """The first ``per_category`` questions of each category, interleaved category by category in a fixed order,
    so that runs with the same N are comparable and a partial run still covers every category."""
    by_cat: dict[str, list[Question]] = {}
    for q in questions:
        by_cat.setdefault(q.category, []).append(q)
    picked = []
    for i in range(per_category):
        for cat in by_cat:
            if i < len(by_cat[cat]):
                picked.append(by_cat[cat][i])
    return picked
