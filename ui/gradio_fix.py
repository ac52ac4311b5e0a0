"""A workaround for gradio 6's per-session copies of output components, which otherwise grow a session's state with
every run.

gradio keeps, per browser session, a copy of each output component that an update changed (``SessionState``'s
``blocks_config``), and each copy gets a new id. A run that leaves an output as it is (an update dict without that
output: gradio fills in ``gr.skip()``, a property update) makes such a copy; when a later update of the same run sets
that output's value, gradio files the copy under the copy's own id as well as the original's, with its config. The
Live tab leaves figures as they are between the frames that redraw them, so every run added 9 entries (5 figures,
3 HTML blocks, a JSON) to the session's blocks and config, never dropped: measured as the app's live memory growing
with every run of a session, 0.23 MB a run (tracemalloc, 20 sessions, 40 one-token runs).

``drop_copies`` removes, from one session's state, the entries filed under ids that are not the page's own; the
copies under the page's ids (the session's current outputs) stay. It is called as each run starts.

gradio also keeps each session's copy of the page (its ``SessionState``: the page's config, the latest figures)
after the browser closes, until its least-recently-used cap (``state_session_capacity``) pushes it out; only the
session's ``gr.State`` values expire (an hour after the close, gradio's rule). ``forget_session``, called when the
session's ``Session`` expires, drops that copy too, then hands the freed heap back to the system (glibc keeps freed
memory otherwise), so that the process's memory goes down again after its users leave.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import lru_cache


def drop_copies(demo, session_hash: str | None) -> int:
    """Drop the session's component copies filed under ids the page does not have; returns how many."""
    holder = getattr(demo, "state_holder", None)
    state = getattr(holder, "session_data", {}).get(session_hash) if holder is not None and session_hash else None
    if state is None:
        return 0
    page = demo.default_config.blocks
    blocks = state.blocks_config.blocks
    stale = [key for key in list(blocks) if key not in page]
    for key in stale:
        blocks.pop(key, None)
        state.config_values.pop(key, None)
    return len(stale)


def forget_session(demo, session_hash: str | None) -> bool:
    """Drop gradio's state of a session whose ``gr.State`` expired (its browser closed), then release the freed
    memory to the system; returns whether there was state to drop."""
    holder = getattr(demo, "state_holder", None)
    data = getattr(holder, "session_data", None)
    if data is None or not session_hash or session_hash not in data:
        return False
    with holder.lock:
        data.pop(session_hash, None)
        getattr(holder, "time_last_used", {}).pop(session_hash, None)
    release_freed_memory()
    return True


@lru_cache(maxsize=1)
def _libc():
    """The C library, looked up once (``find_library`` runs a subprocess); None where it cannot be loaded."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def release_freed_memory() -> bool:
    """Ask glibc to hand the heap's free pages back to the system (``malloc_trim``); False where there is no glibc."""
    trim = getattr(_libc(), "malloc_trim", None)
    return bool(trim(0)) if trim is not None else False
