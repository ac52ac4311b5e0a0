"""Where the shipped assets live: the one module that knows the layout of ``assets/``.

    assets/
      trees/<name>.json                        draft-tree templates, as data (``tree.load_template``)
      hot_start/<model>-k<k>.safetensors       hot-start adjacency matrices (``-m tr_core.tools.build_assets``)
      acceptance/<model>.json                  how often each paper-tree node was accepted (same command)
      traces/<name>.json, <name>.meta.json     the runs "How it works" replays (``-m tr_core.tools.record_trace``)
      spec_bench/question.jsonl                the benchmark's questions (own copy, Apache-2.0)
      prompts/generic.txt                      the prompts the hot-start matrix is built from
      benchmarks/beyond_paper.json             a benchmark's figures for "How it works"
                                               (``python -m tr_core.tools.bench_summary``)

``<model>`` is the model's slug (``model_slug``), e.g. ``smollm2-135m-instruct``:

>>> hot_start_path("smollm2-135m-instruct", 8).name
'smollm2-135m-instruct-k8.safetensors'
>>> acceptance_path("smollm2-135m-instruct").relative_to(ASSETS_DIR).as_posix()
'acceptance/smollm2-135m-instruct.json'
"""

from __future__ import annotations

import json
from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
TREES_DIR = ASSETS_DIR / "trees"
HOT_START_DIR = ASSETS_DIR / "hot_start"
ACCEPTANCE_DIR = ASSETS_DIR / "acceptance"
TRACES_DIR = ASSETS_DIR / "traces"
SPEC_BENCH_QUESTIONS = ASSETS_DIR / "spec_bench" / "question.jsonl"
GENERIC_PROMPTS = ASSETS_DIR / "prompts" / "generic.txt"
BEYOND_PAPER = ASSETS_DIR / "benchmarks" / "beyond_paper.json"


def hot_start_path(slug: str, top_k: int, folder: Path = HOT_START_DIR) -> Path:
    """The file of ``slug``'s hot-start matrix for ``top_k`` candidates per row (it may not exist)."""
    return Path(folder) / f"{slug}-k{top_k}.safetensors"


def hot_start_files(slug: str, top_k: int, folder: Path = HOT_START_DIR) -> list[Path]:
    """Every shipped hot-start matrix of ``slug``, the one of this ``top_k`` first (a matrix saved with a larger k
    gives its top ranks; ``AdjacencyMatrix.load`` says whether one fits)."""
    folder = Path(folder)
    exact = hot_start_path(slug, top_k, folder)
    others = sorted(p for p in folder.glob(f"{slug}-k*.safetensors") if p != exact) if folder.is_dir() else []
    return ([exact] if exact.is_file() else []) + others


def acceptance_path(slug: str, folder: Path = ACCEPTANCE_DIR) -> Path:
    """The file of ``slug``'s acceptance statistics (it may not exist)."""
    return Path(folder) / f"{slug}.json"


def model_slug(model) -> str:
    """The name a model's assets are filed under: the model folder's or hub id's last part, lower-cased."""
    return Path(str(getattr(model.config, "_name_or_path", "model"))).name.lower() or "model"


def acceptance_stats(model, folder: Path = ACCEPTANCE_DIR) -> dict | None:
    """The model's shipped acceptance statistics (``node_paths``, ``acceptance``, ...), or None where it has none."""
    path = acceptance_path(model_slug(model), folder)
    return json.loads(path.read_text()) if path.is_file() else None
