"""CPU profiles of a benchmark process's threads (``BOXCAR_BENCH_CPU_PROFILE=<folder>``): every
thread started after ``start_from_env`` runs under cProfile with the thread's own CPU clock as
its timer, so the figures are CPU seconds (a thread blocked on a socket or in a sleep adds
nothing), in every thread of a worker (engine loop, result writer, lease keeper, Celery's).

A dumper thread writes the merged stats to ``<folder>/<role>-<pid>.prof`` (pstats' format)
every ``DUMP_EVERY_S`` seconds and at exit, so a process stopped at the end of a run leaves its
profile. Read them with ``python -m bench.cpu_profile <folder>``. cProfile's own cost inflates
Python-heavy calls against C ones: compare shares, not absolute times with an unprofiled run.
"""

from __future__ import annotations

import atexit
import cProfile
import glob
import marshal
import os
import pstats
import sys
import threading
import time

DUMP_EVERY_S = 10.0

_profiles: list[cProfile.Profile] = []
_lock = threading.Lock()


def _profiled_run(original):
    def bootstrap_inner(self: threading.Thread) -> None:
        profile = cProfile.Profile(time.thread_time)
        with _lock:
            _profiles.append(profile)
        profile.enable()
        try:
            original(self)
        finally:
            profile.disable()

    return bootstrap_inner


def _dump(path: str) -> None:
    merged: dict = {}
    with _lock:
        profiles = list(_profiles)
    for profile in profiles:
        profile.snapshot_stats()  # reads the profiler's tables; it keeps running
        for func, (cc, nc, tt, ct, callers) in profile.stats.items():  # type: ignore[attr-defined]
            if func in merged:
                mcc, mnc, mtt, mct, mcallers = merged[func]
                for caller, value in callers.items():
                    old = mcallers.get(caller)
                    mcallers[caller] = value if old is None else tuple(
                        a + b for a, b in zip(old, value, strict=True))
                merged[func] = (mcc + cc, mnc + nc, mtt + tt, mct + ct, mcallers)
            else:
                merged[func] = (cc, nc, tt, ct, dict(callers))
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        marshal.dump(merged, f)
    os.replace(tmp, path)


def start_from_env(env: dict[str, str], role: str) -> bool:
    """Profile every thread started from now on if ``BOXCAR_BENCH_CPU_PROFILE`` is set."""
    folder = env.get("BOXCAR_BENCH_CPU_PROFILE")
    if not folder:
        return False
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{role}-{os.getpid()}.prof")

    def dump_forever() -> None:
        while True:
            time.sleep(DUMP_EVERY_S)
            _dump(path)

    # Started before the patch: the dumps (costly: every thread's tables) are not in the profile.
    threading.Thread(target=dump_forever, name="bench-cpu-profile", daemon=True).start()
    # _bootstrap_inner calls run(): patched there, threads that override run() are profiled too.
    threading.Thread._bootstrap_inner = _profiled_run(  # type: ignore[attr-defined]
        threading.Thread._bootstrap_inner)  # type: ignore[attr-defined]
    atexit.register(_dump, path)
    return True


def main(argv: list[str]) -> int:
    if len(argv) < 1:
        print("usage: python -m bench.cpu_profile FOLDER [NUM_LINES]", file=sys.stderr)
        return 2
    files = sorted(glob.glob(os.path.join(argv[0], "*.prof")))
    if not files:
        print(f"no profiles in {argv[0]}", file=sys.stderr)
        return 1
    stats = pstats.Stats(*files)
    print(f"{len(files)} processes, {stats.total_tt:.2f} CPU s in their threads")  # type: ignore[attr-defined]
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(45)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
