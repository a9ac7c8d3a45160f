"""The cost of one engine step, as a worker fits it (``metrics.forecast.StepCost``) and the API
reads it from the worker's published forecast (``api.eta``). Apart from the fit so that a reader
(``boxcar status``) does not import numpy for a dataclass."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cost:
    """Seconds of one step: ``fixed + per_decode * decodes + per_prefill * prefill tokens``."""

    fixed: float
    per_decode: float
    per_prefill: float
