"""What one ``Scheduler.schedule()`` call hands out (``StepBudget``: the token budget, the
scheduled requests, the preempted ones, the less urgent requests' cap) and what admission does
with one waiting request (``Admit``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto

from engine.core.request import Request
from engine.outputs import ScheduledRequest


class Admit(Enum):
    """What admission does with one waiting request."""

    ADMITTED = auto()  # it left the waiting queue for the running one
    HELD = auto()  # passed over this step; the requests behind it are still tried
    RETRY = auto()  # a less urgent running request was preempted for it: try it again
    STOP = auto()  # no more admissions this step


@dataclass
class StepBudget:
    """What one ``schedule()`` call has handed out so far."""

    budget: int
    scheduled: dict[str, ScheduledRequest] = field(default_factory=dict)
    initial_budget: int = field(init=False)
    num_preempted: int = 0
    preempted_ids: set[str] = field(default_factory=set)
    # While priorities differ: the most urgent priority, and the tokens left this step for
    # requests less urgent than it (None: no cap).
    urgent_priority: int | None = None
    bulk_budget: int | None = None
    capped_ids: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.initial_budget = self.budget

    def is_capped(self, request: Request) -> bool:
        """Whether ``request``'s tokens come out of the less urgent requests' budget."""
        return (self.bulk_budget is not None and self.urgent_priority is not None
                and request.priority > self.urgent_priority)

    def cap(self, request: Request, num_new: int) -> int:
        """``num_new`` cut to the less urgent requests' budget left if ``request`` is one."""
        if self.bulk_budget is not None and self.is_capped(request):
            return min(num_new, self.bulk_budget)
        return num_new

    def add(self, scheduled: ScheduledRequest, request: Request | None = None) -> None:
        self.scheduled[scheduled.request_id] = scheduled
        self.budget -= scheduled.num_new_tokens
        if request is not None and self.bulk_budget is not None and self.is_capped(request):
            self.bulk_budget -= scheduled.num_new_tokens
            self.capped_ids.add(scheduled.request_id)

    def remove(self, request_id: str) -> None:
        scheduled = self.scheduled.pop(request_id, None)
        if scheduled is not None:
            self.budget += scheduled.num_new_tokens
            if request_id in self.capped_ids and self.bulk_budget is not None:
                self.bulk_budget += scheduled.num_new_tokens
                self.capped_ids.discard(request_id)
