"""Figures of Token Recycling runs, drawn from step events alone: a live run's or a saved trace's.

Imports plotly, networkx and the event dataclasses only (never torch), so a trace draws anywhere:

    from visualize import load_trace, tree_animation
    events = load_trace("tests/fixtures/trace_paper.json")
    tree_animation(events).write_html("run.html")

Every figure function that names tokens takes an optional ``token_text(id) -> str`` (a tokenizer's decode);
without it, names come from the trace itself (``token_text_map``), ``"#<id>"`` when the trace never decoded one.
"""

from .budget_fig import budget_figure, budget_title
from .charts import (
                     accepted_length_figure,
                     accepted_lengths,
                     methods_figure,
                     projection_figure,
                     race_figure,
                     speedup_figure,
                     tree_size_figure,
)
from .mask_fig import ancestor_mask, mask_figure
from .matrix_fig import matrix_figure, shown_rows
from .palette import use_slim_template
from .trace import label, load_trace, text_lookup, token_text_map, visible
from .tree_fig import step_traces, tree_animation, tree_figure
from .tree_layout import node_roles, tree_layout

use_slim_template()  # every figure of this package: plotly's default look, without the template's unused bytes

__all__ = [
    "accepted_length_figure", "accepted_lengths", "ancestor_mask", "budget_figure", "budget_title", "label",
    "load_trace", "mask_figure", "matrix_figure", "methods_figure", "node_roles", "projection_figure", "race_figure",
    "shown_rows",
    "speedup_figure", "step_traces", "text_lookup", "token_text_map", "tree_animation", "tree_figure", "tree_layout",
    "tree_size_figure", "visible",
]
