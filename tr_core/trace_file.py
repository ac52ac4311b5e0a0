"""A run's trace as a file: every step event, and what a reader elsewhere needs to trust its speed (the machine, the
model, the method and settings, the run's tokens/s and plain decoding's, measured there). ``python -m tr_core
--trace FILE`` writes one; the app's Live tab replays it on any machine, its speeds said to be the recording's.

    write(path, events, meta)                    # {"format": FORMAT, "meta": {...}, "events": [...]}
    events, meta = read(path)                    # a bare list of events (older traces) reads with meta {}
"""

from __future__ import annotations

import json
from pathlib import Path

from .events import StepEvent

FORMAT = "token-recycling-trace/1"
MAX_BYTES = 32 * 2**20  # a trace of 256 tokens with the paper's tree is a few MB


class TraceFileError(ValueError):
    """A file that is not a trace this code can read, with a sentence that says why."""


def write(path: str | Path, events: list[StepEvent], meta: dict) -> None:
    Path(path).write_text(json.dumps({"format": FORMAT, "meta": meta, "events": [e.to_dict() for e in events]},
                                     ensure_ascii=False), encoding="utf-8")


def read(path: str | Path) -> tuple[list[StepEvent], dict]:
    """The events and meta of a trace file; ``TraceFileError`` for anything else (too large, not JSON, not a trace,
    an event that does not read)."""
    path = Path(path)
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise TraceFileError(f"{path.name} is {size / 2**20:.0f} MB; a trace is at most {MAX_BYTES // 2**20} MB.")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceFileError(f"{path.name} is not JSON ({e.__class__.__name__}); a trace is the JSON file that "
                             "`python -m tr_core --trace FILE` writes.") from None
    if isinstance(data, list):  # the bare list of events of older traces
        data = {"format": FORMAT, "meta": {}, "events": data}
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("events"), list):
        raise TraceFileError(f"{path.name} is JSON but not a trace of this app (format {FORMAT!r}, written by "
                             "`python -m tr_core --trace FILE`).")
    if not data["events"]:
        raise TraceFileError(f"{path.name} holds no decoding step.")
    try:
        events = [StepEvent.from_dict(d) for d in data["events"]]
    except (TypeError, ValueError, AttributeError) as e:
        raise TraceFileError(f"{path.name}: a step event does not read ({e}).") from None
    if [e.step for e in events] != list(range(len(events))):
        raise TraceFileError(f"{path.name}: the steps are not numbered 0, 1, 2, ... in order.")
    for e in events:
        if not _well_formed(e):
            raise TraceFileError(f"{path.name}: step {e.step} is not a well-formed step event (its tree, path and "
                                 "tokens do not fit together).")
    meta = data.get("meta") if isinstance(data.get("meta"), dict) else {}
    return events, meta


def _well_formed(e: StepEvent) -> bool:
    """Whether an event's lists fit together as the figures read them: ints, one parent and text per tree node,
    an accepted path of node indices from the root."""
    lists = (e.tree_tokens, e.tree_parents, e.new_tokens, e.accepted_path)
    if not all(isinstance(x, list) and all(isinstance(v, int) for v in x) for x in lists):
        return False
    n = len(e.tree_tokens)
    return (n >= 1 and len(e.tree_parents) == n and len(e.tree_text) == n and isinstance(e.new_text, str)
            and bool(e.accepted_path) and e.accepted_path[0] == 0 and all(0 <= i < n for i in e.accepted_path)
            and all(-1 <= p < n for p in e.tree_parents) and isinstance(e.bonus_token, int))
