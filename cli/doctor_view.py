"""What ``boxcar doctor``'s rules share: the ``Finding`` they return, the ``View`` they read a
snapshot through, and ``NotEnoughData`` for a rule the snapshot cannot decide."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from metrics.snapshot import mean, quantile

# Fewer engine steps than this is too little to judge step-level behaviour.
MIN_STEPS = 20
# Fewer finished requests than this is too little to judge latencies.
MIN_REQUESTS = 8


@dataclass(frozen=True)
class Finding:
    rule: str
    severity: str  # "critical" | "warning"
    title: str
    evidence: str
    remedy: str

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


class NotEnoughData(Exception):
    """The snapshot cannot support or refute the rule."""


class View:
    """Read helpers over a snapshot."""

    def __init__(self, snapshot: dict[str, Any]) -> None:
        self.snapshot = snapshot
        self.config: dict[str, Any] = snapshot.get("config") or {}
        self.timeline: list[dict[str, Any]] = snapshot.get("timeline") or []

    def counter(self, key: str) -> float:
        return float(self.snapshot.get("counters", {}).get(key, 0.0))

    def gauge(self, key: str) -> float:
        return float(self.snapshot.get("gauges", {}).get(key, 0.0))

    def histogram(self, key: str) -> dict[str, Any] | None:
        return self.snapshot.get("histograms", {}).get(key)

    def count(self, key: str) -> float:
        hist = self.histogram(key)
        return float(hist["count"]) if hist else 0.0

    def quantile(self, key: str, p: float) -> float:
        """The p-quantile (0..1) of a histogram; NotEnoughData when it has no observations."""
        value = quantile(self.histogram(key), p)
        if value is None:
            raise NotEnoughData(f"no {key} observations")
        return value

    def mean(self, key: str) -> float:
        value = mean(self.histogram(key))
        if value is None:
            raise NotEnoughData(f"no {key} observations")
        return value

    @property
    def steps(self) -> float:
        return self.count("prefill_step_s") + self.count("decode_step_s")

    def need_steps(self) -> None:
        if self.steps < MIN_STEPS:
            raise NotEnoughData(f"{self.steps:.0f} engine steps (need {MIN_STEPS})")

    def need_requests(self) -> None:
        if self.counter("requests_finished") < MIN_REQUESTS:
            raise NotEnoughData(f"{self.counter('requests_finished'):.0f} finished requests "
                                f"(need {MIN_REQUESTS})")

    def setting(self, name: str) -> Any:
        if name not in self.config:
            raise NotEnoughData(f"the engine's {name} is unknown")
        return self.config[name]

    def busy_points(self) -> list[dict[str, Any]]:
        return [p for p in self.timeline if p.get("steps", 0) > 0]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def pct(x: float) -> str:
    return f"{100 * x:.0f}%"
