"""``diagnose(snapshot)``: which of the eight classic serving failures a metrics snapshot shows.

A snapshot (``metrics.catalog``) comes from ``boxcar run --metrics-json``, a worker, or a
/metrics page (``cli.doctor_commands``). Each rule (``cli.doctor_rules``) is a plain
function of it that returns a ``Finding`` with the numbers that convicted it and what to change,
or None; a rule without enough data to judge raises ``NotEnoughData`` and is reported as not
evaluated. Every threshold is a named constant in ``cli.doctor_rules``.
"""

from __future__ import annotations

from typing import Any

from cli.doctor_rules import RULES
from cli.doctor_view import Finding, NotEnoughData, View

__all__ = ["Finding", "diagnose", "diagnose_report"]

SEVERITY_ORDER = {"critical": 0, "warning": 1}


def diagnose_report(snapshot: dict[str, Any]) -> tuple[list[Finding], dict[str, str]]:
    """The findings, most severe first, and the rules not evaluated with the reason why."""
    view = View(snapshot)
    findings: list[Finding] = []
    skipped: dict[str, str] = {}
    for rule_id, rule in RULES:
        try:
            finding = rule(view)
        except NotEnoughData as exc:
            skipped[rule_id] = str(exc)
            continue
        if finding is not None:
            findings.append(finding)
    findings.sort(key=lambda f: SEVERITY_ORDER.get(f.severity, 9))
    return findings, skipped


def diagnose(snapshot: dict[str, Any]) -> list[Finding]:
    """Which of the eight patterns ``snapshot`` shows, most severe first."""
    return diagnose_report(snapshot)[0]
