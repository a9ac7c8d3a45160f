"""``BOXCAR_WORKER_NICE``: a worker raises its niceness, and its autogroup's where it leads its own
session, to at least the setting; never lowers either."""

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


AUTOGROUP = """
import sys
from cli.service_commands import lower_priority
lower_priority(int(sys.argv[1]), autogroup=sys.argv[2])
"""


def test_a_worker_leading_its_own_session_lowers_its_autogroup(tmp_path):
    """With sched_autogroup a session is scheduled as one group: its niceness counts only
    inside it, so a worker in a session of its own lowers the group's (a file standing in for
    /proc/self/autogroup); one in another's session leaves the group alone."""
    for new_session, expected in ((True, "7\n"), (False, "/autogroup-12 nice 0\n")):
        group = tmp_path / f"autogroup-{new_session}"
        group.write_text("/autogroup-12 nice 0\n")
        subprocess.run([sys.executable, "-c", AUTOGROUP, "7", str(group)], check=True,
                       start_new_session=new_session)
        assert group.read_text() == expected, new_session
    higher = tmp_path / "already-higher"
    higher.write_text("/autogroup-12 nice 12\n")
    subprocess.run([sys.executable, "-c", AUTOGROUP, "7", str(higher)], check=True,
                   start_new_session=True)
    assert higher.read_text() == "/autogroup-12 nice 12\n"  # never lowered
