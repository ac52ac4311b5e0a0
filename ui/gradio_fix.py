"""A workaround for gradio 6's per-session copies of output components, which otherwise grow a session's state with
every run.

gradio keeps, per browser session, a copy of each output component that an update changed (``SessionState``'s
``blocks_config``), and each copy gets a new id. A run that leaves an output as it is (an update dict without that
output: gradio fills in ``gr.skip()``, a property update) makes such a copy; when a later update of the same run sets
that output's value, gradio files the copy under the copy's own id as well as the original's, with its config. The
Live tab leaves figures as they are between the frames that redraw them, so every run added 9 entries (5 figures,
3 HTML blocks, a JSON) to the session's blocks and config, never dropped: measured as the app's live memory growing
with every run of a session, 0.23 MB a run (tracemalloc, 20 sessions, 40 one-token runs).

``drop_copies`` removes, from one session's state, the entries filed under ids that are not the page's own, and
puts the page's own component back under its id where the session's copy differs from it only by its value (a copy
made by ``gr.skip()`` or a value update: gradio keeps no value in it, so the two serve alike); copies whose
properties an update changed stay. It is called as each run starts and as it ends (the copies of its last frame);
the follow-up after a Live run (the step slider, the "watch" button) makes a few more, kept until the next run.
Measured, a session after a 64-token Live run held 9 such copies, ~41 KB of its ~90 KB (``session_bytes``).

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
    """Drop the session's component copies filed under ids the page does not have, and those that differ from the
    page's component only by value (the page's own goes back under its id); returns how many."""
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
    alike = [(key, block) for key, block in list(blocks.items())
             if key in page and block is not page[key] and _same_but_value(block, page[key])]
    for key, block in alike:
        if blocks.get(key) is block:  # not replaced meanwhile by an event of the same session
            blocks[key] = page[key]
    return len(stale) + len(alike)


def _same_but_value(copy, original) -> bool:
    """Whether a session's copy of a component was built with the page's component's arguments but its value (gradio
    builds a copy from the arguments with ``render=False`` and no value)."""
    def arguments(block) -> dict:
        return {k: v for k, v in getattr(block, "constructor_args", {}).items() if k not in ("value", "render")}

    try:
        return type(copy) is type(original) and bool(arguments(copy) == arguments(original))
    except Exception:  # an argument that cannot be compared (an array): keep the copy
        return False


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


class CopiedAsItself:
    """A callable that copies (shallow or deep) as itself. gradio deep-copies the page's config at every page load
    (``GET /config``), and the config holds the arguments of every component, the session ``gr.State``'s
    ``delete_callback`` among them. A bound method of the app's handlers there made each page load deep-copy the
    handlers, the model cache and its loaded models' weights, then fail on a lock and start again part by part
    (gradio's ``safe_deepcopy``): measured, 8-12 s a page load with the default model loaded (5 s is gradio_client's
    timeout for it)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        return f"CopiedAsItself({getattr(self.fn, '__qualname__', self.fn)!r})"


def retained_bytes(root, shared: set[int]) -> int:
    """The bytes of every object reachable from ``root`` that is not in ``shared`` (ids) nor reached only through
    one: Python objects by ``sys.getsizeof``, tensors with their data (numpy arrays that own their data count it in
    ``getsizeof``). Classes, functions, bound methods, modules and torch modules are never counted or followed (the
    process's, not the object's): what is reachable only through them is left out. Something shared that is reached
    by a way ``shared`` does not stop (an interned string) is counted."""
    import gc
    import sys
    import types

    import torch

    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
            torch.nn.Module)
    seen, stack, total = set(shared), [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, torch.Tensor) and obj._base is None and obj.layout == torch.strided:
            total += obj.untyped_storage().nbytes()
        stack.extend(gc.get_referents(obj))
    return total


def session_bytes(demo, session_hash: str) -> int:
    """What one browser session of ``demo`` holds alone, in bytes: gradio's state of it (its copy of the page's
    blocks, the components its runs updated, its ``gr.State`` values: the app's ``Session``), less what every session
    shares (the page's own components and functions, the shared starting matrices, ``ui.session.shared_start``).
    0 for a session gradio does not hold."""
    from . import session as session_module

    state = demo.state_holder.session_data.get(session_hash)
    if state is None:
        return 0
    config = demo.default_config
    shared = {id(x) for x in [demo, *config.blocks.values(), *config.fns.values()]}
    for matrix, _ in list(session_module._SHARED.values()):
        shared.update((id(matrix), id(matrix.rows), id(matrix.probs)))
    return retained_bytes(state, shared)
