"""Waiting for the machine to be quiet before a timed step: the browser that draws the page may share this machine.

A page open on the machine that serves it (the app on a laptop) draws every frame the server streams, and on a
small CPU that drawing kept about one core busy for the whole of a live run (Chromium, 2 vCPUs: 0.8-1.2 cores, in
25 ms windows, against 0.0-0.4 with the page idle). Whatever step ran while the browser drew was billed for it, and
within a live step that was Token Recycling's, which ran first after a frame: the page said 0.82-0.88x where the
same run measured 1.0-1.1x through the API. So after each frame it sends, a run waits, untimed, until everything on
this machine but the decoding thread (other processes such as the browser, and this process's other threads: the
server encoding the frame, an API client in the same process) uses no more CPU than before the run (``Quiet.wait``),
then times its next step. Where the browser runs elsewhere (a Space, a remote API client) the first windows already
read quiet.

A wait leaves the CPU idle, and the first pass after it ran slower: on the 2-vCPU machine a Token Recycling tree
pass (13 rows, exact mode) took 3.3 ms more right after a 60 ms sleep than the passes after it (77.6 against 74.1-74.4
ms, medians over 3 runs of 128 tokens), a one-row pass of plain decoding 0.3 ms more (47.4 against 47.1-47.3): the
compute-heavy pass pays for the idle cores, so waiting after every frame billed Token Recycling ~4% that a race (which
does not wait between steps) does not see. So after the quiet windows the wait keeps both cores busy for ``WARM_S``
(untimed, a small matmul on torch's threads); with 30 ms of it the first tree pass after the sleep took 72.4 ms against
71.5-72.1 for the later ones.

    quiet = Quiet()          # reads the machine's background (other processes' CPU) now
    ...send a frame...
    quiet.wait()             # returns once they are back to it (or after ``cap_s``) and the cores are warm again

The CPU figures come from ``psutil`` (the kernel's counters for the whole machine) less the calling thread's own
time; where they cannot be read the wait returns at once and ``available`` says so.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

try:
    import psutil
except ImportError:  # pragma: no cover - pinned in requirements.txt
    psutil = None

# A window's reading is other processes' CPU over the window in cores. The kernel counts in ticks of 10 ms a core, so
# over 50 ms one tick more or less reads as 0.2 cores: "quiet" is the background plus a quarter of a core. (With 25 ms
# windows a tick read 0.4 cores, so quiet had to allow half a core, and a browser still drawing at under half a core
# passed for quiet: with Chromium open on the page, Live read 1.04-1.06x against a race of 1.08-1.13x on the default
# prompt, 0.97x against 1.07-1.13x on the Fibonacci example; with 50 ms windows 1.09-1.15x against 1.17-1.22x and
# 1.01-1.02x against 1.04-1.05x, one run of each.)
WINDOW_S = 0.05
ABOVE_BACKGROUND = 0.25
CAP_S = 0.6  # the longest wait after one frame; a machine busy for longer is said so (``capped``)
# A browser's drawing of a frame is many tasks with short gaps between them (one window in a busy stretch read 0.4
# cores): quiet is this many windows in a row; the frame leaves as the wait starts, so the first windows may come
# before the browser has begun
QUIET_WINDOWS = 2
# The background is the quietest of the last RECENT windows read, by every run of this process (about 5 s of waiting):
# one run alone may start while the browser still draws the page's last frame, and read that as its background
RECENT = 200
_recent: deque = deque(maxlen=RECENT)
# A run reads the background as it starts, window by window until one reads IDLE or BACKGROUND_WINDOWS (0.5 s) have
# passed: Run was just clicked, and the browser on this machine may still be drawing the page's answer to the click.
# A first run read its one window then, as 1 core or so, took that for the background and waited for nothing: with
# Chromium open on the page, 0.73x where the race read 1.03-1.14x.
IDLE = 0.1
BACKGROUND_WINDOWS = 10
# Busy time after a wait, before the next timed step: the cores back at speed (see above). Longer only costs wall time.
WARM_S = 0.03


def warm_cores(seconds: float) -> None:
    """Keep torch's threads busy for ``seconds`` (small matmuls), so that the next timed step does not start on idle
    cores."""
    import torch

    a = torch.ones(192, 192)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        torch.mm(a, a)


def other_cpu_seconds() -> float | None:
    """CPU seconds used so far by everything on this machine but the calling thread (all cores), or ``None``: other
    processes (a browser drawing the page) and this process's other threads too (the server encoding and sending the
    frame just yielded, an API client in the same process parsing it; torch's own threads sit idle between steps)."""
    if psutil is None:
        return None
    try:
        t = psutil.cpu_times()
    except Exception:  # no permission, a platform psutil does not cover
        return None
    busy = sum(getattr(t, field, 0.0) for field in ("user", "nice", "system", "irq", "softirq"))
    return busy - time.thread_time()


class Quiet:
    """Waits until the machine's other processes are back to their background use of the CPU.

    ``others`` reads their CPU seconds so far (``other_cpu_seconds``), ``clock`` and ``sleep`` the time, ``warm``
    keeps the cores busy for ``warm_s`` after a wait (``warm_cores``): a test passes stubs, and its own ``recent``
    readings (by default the process's, shared by every run: ``RECENT``).

    >>> now = [0.0]
    >>> def sleep(s): now[0] += s
    >>> used = iter([0.0, 0.0, 0.0,   0.0, 0.025,  0.025, 0.030,  0.030, 0.030]).__next__  # idle; 0.5 core, 0.1, 0
    >>> quiet = Quiet(others=used, clock=lambda: now[0], sleep=sleep, recent=deque(maxlen=RECENT), warm=sleep)
    >>> round(quiet.background, 2), round(quiet.wait(), 3), quiet.frames, quiet.capped
    (0.0, 0.18, 1, 0)
    """

    def __init__(self, others: Callable[[], float | None] = other_cpu_seconds, clock: Callable[[], float] =
                 time.perf_counter, sleep: Callable[[float], None] = time.sleep, window_s: float = WINDOW_S,
                 cap_s: float = CAP_S, recent: deque | None = None, warm: Callable[[float], None] = warm_cores,
                 warm_s: float = WARM_S):
        self.others, self.clock, self.sleep, self.window_s, self.cap_s = others, clock, sleep, window_s, cap_s
        self.warm, self.warm_s = warm, warm_s
        self.recent = _recent if recent is None else recent
        self.waited_s, self.frames, self.capped = 0.0, 0, 0
        self.available = self.others() is not None
        if self.available:  # the background: windows until one reads idle, the page drawn (or BACKGROUND_WINDOWS)
            for _ in range(BACKGROUND_WINDOWS):
                if self._window() <= IDLE:
                    break

    def _window(self) -> float:
        """Other processes' CPU over the next window, in cores."""
        before, started = self.others(), self.clock()
        self.sleep(self.window_s)
        after, ended = self.others(), self.clock()
        if before is None or after is None:
            return 0.0
        cores = (after - before) / max(ended - started, 1e-9)
        self.recent.append(cores)
        return cores

    @property
    def background(self) -> float:
        """Other processes' use of the CPU with no page drawing: the quietest recent window, in cores."""
        return max(0.0, min(self.recent, default=0.0))  # below 0: a tick counted on the other side of a window

    def wait(self) -> float:
        """Sleep, window by window, until ``QUIET_WINDOWS`` windows in a row read no more than the background plus
        ``ABOVE_BACKGROUND`` cores, or ``cap_s`` has passed, then warm the cores for ``warm_s``; the seconds
        waited, the warming included."""
        if not self.available:
            return 0.0
        started, calm = self.clock(), 0
        while calm < QUIET_WINDOWS:
            calm = calm + 1 if self._window() <= self.background + ABOVE_BACKGROUND else 0
            if calm < QUIET_WINDOWS and self.clock() - started >= self.cap_s:
                self.capped += 1
                break
        self.warm(self.warm_s)
        waited = self.clock() - started
        self.waited_s += waited
        self.frames += 1
        return waited

    def describe(self) -> str:
        """What the waits came to, for the run's details: ``""`` before any frame."""
        if not self.available:
            return "the machine's CPU use could not be read here, so no step waited for the page's drawing"
        if not self.frames:
            return ""
        frames = f"{self.frames} frame{'s' * (self.frames != 1)}"
        line = (f"after the {frames} sent, decoding waited each time (untimed) until the machine's other "
                f"processes, such as a browser drawing the page here, were back to their use before the run, then "
                f"kept the cores busy for {self.warm_s * 1000:.0f} ms so that the next step did not start on idle "
                f"cores: {self.waited_s:.1f} s in all")
        if self.capped:
            line += f"; {self.capped} time{'s' * (self.capped != 1)} they stayed busy past {self.cap_s:.1f} s"
        return line
