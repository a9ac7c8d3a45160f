"""``BOXCAR_WORKER_NICE``: a worker raises its niceness to at least the setting, never lowers it."""

import subprocess
import sys

CHECK = """
import os
from cli.service_commands import lower_priority
start = os.nice(0)
print(lower_priority(start + 5), lower_priority(start + 2), lower_priority(0), os.nice(0) - start)
"""


def test_lower_priority_raises_to_at_least_and_never_lowers():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                         check=True).stdout.split()
    first, second, third, raised = map(int, out)
    assert first == second == third and raised == 5
