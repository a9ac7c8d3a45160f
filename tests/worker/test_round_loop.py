"""service.loop.RoundLoop: rounds until stopped, a failed round does not end the loop, wake()
cuts the sleep short, a round that did work is followed at once."""

from __future__ import annotations

import threading
import time

from service.loop import RoundLoop


class Rounds(RoundLoop):
    def __init__(self, interval: float, script: list[object]) -> None:
        super().__init__(interval)
        self.script = script
        self.times: list[float] = []

    def run_round(self) -> bool:
        self.times.append(time.monotonic())
        step = self.script.pop(0) if self.script else False
        if isinstance(step, Exception):
            raise step
        return bool(step)


def test_failed_rounds_are_survived_and_busy_rounds_repeat_at_once() -> None:
    loop = Rounds(10.0, [True, RuntimeError("boom"), False])
    stop = threading.Event()
    thread = threading.Thread(target=loop.run, args=(stop,))
    thread.start()
    deadline = time.monotonic() + 5
    while len(loop.times) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(loop.times) == 2  # the busy round was followed at once; the failed one slept
    loop.wake()  # cuts the 10 s sleep short
    while len(loop.times) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(loop.times) == 3
    stop.set()
    loop.wake()
    thread.join(2)
    assert not thread.is_alive()
    assert loop.times[1] - loop.times[0] < 1.0
