"""What the page says it draws is drawn so, read from the figures a live run sends: nodes copied from the context
are diamonds (the walkthrough's page 9 and docs/app.md say so); and Live's Draft tree picker is off, with its reason,
for a method that does not draft with it."""

from __future__ import annotations

from test_app import settings

from ui.frames import live_frame
from ui.run import LiveRun
from ui.session import Session

REPEATING = ("Repeat exactly, twice: the quick brown fox jumps over the lazy dog. "
             "the quick brown fox jumps over the lazy dog.")


def node_symbols(figure) -> list[str]:
    """Every node's marker symbol in a tree figure (the traces with a hover text: the nodes, not the legend keys)."""
    out = []
    for trace in figure.data:
        if getattr(trace, "hovertext", None):
            symbol = trace.marker.symbol
            out += list(symbol) if isinstance(symbol, (list, tuple)) else [symbol] * len(trace.x)
    return out


def test_nodes_copied_from_the_context_are_drawn_as_diamonds(app_models):
    session = Session()
    run = LiveRun(session, app_models, settings(max_new_tokens=32, prompt=REPEATING, method="tr-context"))
    run.prepare()
    frames = [(snap.events[-1], live_frame(snap, run, True, session)) for snap in run.snapshots() if snap.events]
    with_context = [(e, f) for e, f in frames if "context" in e.tree_sources and "draft_tree" in f]
    assert with_context, "no step drafted from the context on a repeating prompt"
    for event, frame in with_context:
        symbols = node_symbols(frame["draft_tree"])
        copied = sum(s == "context" for s in event.tree_sources[1:])
        assert sum("diamond" in s for s in symbols) == copied, (event.tree_sources, symbols)
    assert any("diamond" in str(t.marker.symbol) for t in with_context[0][1]["draft_tree"].data
               if not getattr(t, "hovertext", None)), "the legend names the diamond"


def test_the_tree_picker_is_off_with_a_reason_for_methods_that_do_not_use_it():
    import app

    assert app.tree_picker("tr").interactive is True
    for method in ("tr-context", "tr-dynamic", "pld", "lookahead", "plain"):
        picker = app.tree_picker(method)
        assert picker.interactive is False and "applies to Token Recycling only" in picker.info, method
