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
copies under the page's ids (the session's current outputs) stay. It is called as each run starts and as it
ends (the copies of its last frame: an idle session keeps none).

gradio also keeps each session's copy of the page (its ``SessionState``: the page's config, the latest figures)
after the browser closes, until its least-recently-used cap (``state_session_capacity``) pushes it out; only the
session's ``gr.State`` values expire (an hour after the close, gradio's rule). ``forget_session``, called when the
session's ``Session`` expires, drops that copy too, then hands the freed heap back to the system (glibc keeps freed
memory otherwise), so that the process's memory goes down again after its users leave.

And each ``SessionState`` keeps, in ``config_values``, the config of every component of the page with its latest
value (the whole page's config, ~230 KB, from the session's first request on; then every figure a run drew, as
plotly JSON), for one use: gradio's deep links (``/gradio_api/deep_link``, a ``gr.DeepLinkButton``), which this app
does not offer. ``keep_no_deep_link_state`` makes every session of a launched app keep none of it: measured, a
session after one 64-token Live run went from 1.9 MB of live memory to what ``docs/app.md`` gives.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections import OrderedDict
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


class _NothingKept(dict):
    """A session's ``config_values`` that holds nothing: gradio writes into it (ignored) and reads it back (an empty
    config, which has no ``props`` to fill). It answers that it holds every key, so that gradio does not build a
    component's config (``config_for_block``) to fill it at every event and every streamed frame."""

    def __setitem__(self, key, value) -> None:
        pass

    def __contains__(self, key) -> bool:
        return True

    def __missing__(self, key) -> dict:
        return {}


class _SlimSessions(OrderedDict):
    """gradio's sessions by id (``StateHolder.session_data``, an LRU): each session put in keeps no deep-link
    state."""

    def __setitem__(self, key, state) -> None:
        state.config_values = _NothingKept()
        super().__setitem__(key, state)


def _slim(holder) -> None:
    if isinstance(holder.session_data, _SlimSessions):
        return
    with holder.lock:
        slim = _SlimSessions()
        for key, state in list(holder.session_data.items()):
            slim[key] = state
        holder.session_data = slim


@lru_cache(maxsize=1)
def _hook_set_blocks() -> None:
    """Once per process: gradio's ``StateHolder.set_blocks`` (called as an app is launched, before it serves) slims
    the holder of an app marked by ``keep_no_deep_link_state``; other apps' holders are left as they are."""
    from gradio.state_holder import StateHolder

    original = StateHolder.set_blocks

    def set_blocks(self, blocks) -> None:
        original(self, blocks)
        if getattr(blocks, "_keeps_no_deep_link_state", False):
            _slim(self)

    StateHolder.set_blocks = set_blocks


def keep_no_deep_link_state(demo) -> None:
    """Make every session of ``demo`` keep no copy of the page's config and latest values for deep links (see the
    module's text): from its launch on, or at once for an app already launched. Idempotent."""
    demo._keeps_no_deep_link_state = True
    _hook_set_blocks()
    holder = getattr(demo, "state_holder", None)
    if holder is not None:
        _slim(holder)


M_ARENA_MAX = -8  # glibc's mallopt parameter: the most malloc arenas the process makes


def limit_malloc_arenas(arenas: int = 2) -> bool:
    """Let glibc make at most ``arenas`` malloc arenas from now on (it makes up to 8 a core, one per thread that
    allocates while another holds an arena: gradio's worker threads). Fewer arenas, less freed memory stranded
    between them. Measured, 20 sessions x 10 one-token runs through gradio_client, the app in its own process: its
    RSS grew 0.21 MB a run with glibc's default (0.18 and 0.21 on earlier days), 0.06 MB a run with
    ``MALLOC_ARENA_MAX=2`` and 0.11 MB a run with this call in ``app.main``, one run each. Call it before the threads
    start. False where there is no glibc."""
    mallopt = getattr(_libc(), "mallopt", None)
    return bool(mallopt(M_ARENA_MAX, arenas)) if mallopt is not None else False
