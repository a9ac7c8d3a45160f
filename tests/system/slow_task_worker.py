"""``boxcar`` on the scale benchmark's fake engine (``bench.scale_worker``) whose Celery tasks
outlive the broker's visibility timeout: a message's first delivery waits
``BOXCAR_TEST_TASK_SECONDS`` before its task body runs (and its late ack), so kombu puts it back
on the queue and a second delivery runs the body too. Every run of a redelivered message is
logged as ``redelivered <task name>[<task id>]`` for the test to count. Test-only; run as
``python -m tests.system.slow_task_worker worker ...``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from celery import signals

from bench.scale_worker import main

log = logging.getLogger("boxcar.test.slow_task")
TASK_SECONDS = float(os.environ.get("BOXCAR_TEST_TASK_SECONDS", "0"))


def _before_task(task_id: str, task: Any, **_kwargs: Any) -> None:
    if task.request.delivery_info.get("redelivered"):
        log.warning("redelivered %s[%s]", task.name, task_id)
    elif TASK_SECONDS:
        time.sleep(TASK_SECONDS)


signals.task_prerun.connect(_before_task, weak=False)

if __name__ == "__main__":
    sys.exit(main())
