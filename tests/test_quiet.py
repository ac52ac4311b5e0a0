"""The wait between a frame and the next timed step (ui.quiet), on stubbed CPU readings and a stubbed clock."""

from __future__ import annotations

from collections import deque

import pytest

from ui.quiet import BACKGROUND_WINDOWS, CAP_S, QUIET_WINDOWS, WINDOW_S, Quiet


def stubbed(readings_cores: list[float]):
    """A Quiet whose successive windows read ``readings_cores`` (other processes' CPU, in cores)."""
    now, used = [0.0], [0.0]
    windows = iter(readings_cores)

    def others():
        return used[0]

    def sleep(s):
        now[0] += s
        used[0] += next(windows, 0.0) * s

    return Quiet(others=others, clock=lambda: now[0], sleep=sleep, recent=deque(maxlen=50), warm=lambda s: None)


def test_a_busy_browser_is_waited_for_until_quiet_windows_in_a_row():
    # background window 0; then a browser drawing (1.2 cores) with one short gap, then quiet
    quiet = stubbed([0.0, 1.2, 0.4, 1.2, 1.2, 0.0, 0.0, 1.2])
    waited = quiet.wait()
    assert abs(waited - 6 * WINDOW_S) < 1e-9  # the gap (0.4) alone did not end it: QUIET_WINDOWS in a row did
    assert QUIET_WINDOWS == 2 and quiet.frames == 1 and quiet.capped == 0
    assert "after the 1 frame sent" in quiet.describe() and "s in all" in quiet.describe()


def test_no_browser_here_costs_two_windows_and_a_busy_machine_is_capped_and_said():
    assert abs(stubbed([0.0] * 10).wait() - QUIET_WINDOWS * WINDOW_S) < 1e-9
    busy = stubbed([0.0] + [1.5] * 1000)
    assert CAP_S <= busy.wait() < CAP_S + 2 * WINDOW_S
    assert busy.capped == 1 and "stayed busy" in busy.describe()


def test_the_background_is_the_quietest_recent_window_never_below_zero():
    # made while the browser still drew the page's answer to the click: the run reads on until a window is idle
    quiet = stubbed([0.9, 1.1, 0.0, 1.2])
    assert quiet.background == 0.0 and list(quiet.recent) == pytest.approx([0.9, 1.1, 0.0])
    busy = stubbed([0.9] * 3 + [0.7] * 30)  # never idle: BACKGROUND_WINDOWS read, the quietest is the background
    assert len(busy.recent) == BACKGROUND_WINDOWS and busy.background == pytest.approx(0.7)
    assert stubbed([-0.4]).background == 0.0  # a tick counted on the other side of a window


def test_where_the_cpu_cannot_be_read_nothing_waits():
    quiet = Quiet(others=lambda: None)
    assert not quiet.available and quiet.wait() == 0.0 and "could not be read" in quiet.describe()


def test_after_each_wait_the_cores_are_warmed_before_the_next_timed_step():
    """A wait leaves the CPU idle and the next tree pass ran slower (ui.quiet): every wait, quiet at once or capped,
    ends with ``warm_s`` of busy work, and the seconds it reports include it; no wait, no warming."""
    now, warmed = [0.0], []

    def warm(seconds):
        warmed.append(seconds)
        now[0] += seconds

    quiet = Quiet(others=lambda: 0.0, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s),
                  recent=deque(maxlen=50), warm=warm, warm_s=0.03)
    assert warmed == []  # reading the background warms nothing
    assert abs(quiet.wait() - (QUIET_WINDOWS * WINDOW_S + 0.03)) < 1e-9 and warmed == [0.03]
    quiet.wait()
    assert warmed == [0.03, 0.03] and "busy for 30 ms" in quiet.describe()
    assert Quiet(others=lambda: None, warm=warm).wait() == 0.0 and len(warmed) == 2
