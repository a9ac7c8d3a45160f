"""compose/docker-compose.yml is valid (``docker-compose config``, Debian's docker-compose)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.conftest_services import REPO


def test_compose_file_is_valid():
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (apt-get install docker-compose)")
    compose = os.path.join(REPO, "compose", "docker-compose.yml")
    result = subprocess.run([binary, "-f", compose, "config"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    for service in ("api", "worker-gpu0", "redis", "postgres", "s3", "migrate"):
        assert f"  {service}:" in result.stdout
    profiles = subprocess.run([binary, "-f", compose, "--profile", "multi-gpu", "config",
                               "--services"], capture_output=True, text=True, timeout=60)
    assert "worker-gpu1" in profiles.stdout.split()
