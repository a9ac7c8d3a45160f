"""service.loop.RoundLoop: rounds until stopped, a failed round does not end the loop, wake()
cuts the sleep short, a round that did work is followed at once, an idle loop backs off.

The loop's wake event is replaced by one that records each sleep the loop asks for and returns
at once, so the loop runs on the test's thread and nothing here waits on a clock."""

from __future__ import annotations

import threading

from service.loop import RoundLoop


class RecordingWake(threading.Event):
    """The loop's wake event: ``wait`` records its timeout and returns without sleeping (True
    when ``wake()`` was called since the last round, as a real wait would)."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[tuple[float | None, bool]] = []  # (timeout, woken)

    def wait(self, timeout: float | None = None) -> bool:
        woken = self.is_set()
        self.waits.append((timeout, woken))
        return woken


class Rounds(RoundLoop):
    """Runs ``script``: True (did work), False (nothing), an exception (fails), "wake" (calls
    wake() and did nothing); stops the loop when the script is done."""

    def __init__(self, script: list[object], *, idle: bool = False,
                 idle_interval: float | None = None) -> None:
        super().__init__(10.0, idle_interval=idle_interval)
        self._wake = RecordingWake()
        self.script = script
        self.idle = idle
        self.stop = threading.Event()
        self.rounds = 0

    def run_round(self) -> bool:
        self.rounds += 1
        if not self.script:
            self.stop.set()
            return False
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        if step == "wake":
            self.wake()
            return False
        return bool(step)

    def is_idle(self) -> bool:
        return self.idle


def test_failed_rounds_are_survived_and_busy_rounds_repeat_at_once() -> None:
    loop = Rounds([True, True, RuntimeError("boom"), False, "wake"])
    loop.run(loop.stop)
    assert loop.rounds == 6  # the failure did not end the loop; the empty script did
    wake = loop._wake
    assert isinstance(wake, RecordingWake)
    # Two busy rounds, no sleep after either; then a sleep of the interval after the failed
    # round and after each idle one; the round that called wake() had its sleep cut short.
    assert wake.waits == [(10.0, False), (10.0, False), (10.0, True), (10.0, False)]


def test_an_idle_loop_backs_off_and_a_wake_resets_it() -> None:
    loop = Rounds([False, False, False, False, "wake", False], idle=True, idle_interval=35.0)
    loop.run(loop.stop)
    timeouts = [timeout for timeout, _ in loop._wake.waits]  # type: ignore[attr-defined]
    # Doubling from the interval up to idle_interval; the woken sleep starts over.
    assert timeouts == [10.0, 20.0, 35.0, 35.0, 35.0, 10.0, 20.0]
