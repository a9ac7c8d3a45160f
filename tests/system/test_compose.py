"""compose/docker-compose.yml is valid (``docker-compose config``, Debian's docker-compose) and
runs in order: every long-running service has a healthcheck and a restart policy, the workers
wait for the one-shot migrate and model-pull services and for healthy dependencies, and share
the model cache volume; the image is the CUDA one with a compiler."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import yaml

from tests.conftest_services import REPO

COMPOSE = os.path.join(REPO, "compose", "docker-compose.yml")
ONE_SHOT = ("migrate", "model-pull")


def mounts(service: dict) -> dict[str, str]:
    """target -> source of a service's volumes (short "src:dst[:mode]" or long syntax)."""
    found = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target = volume.split(":")[:2]
        else:
            source, target = volume["source"], volume["target"]
        found[target] = source
    return found


def compose_config(*profiles: str, env: dict[str, str] | None = None) -> dict:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (apt-get install docker-compose)")
    args = [binary, "-f", COMPOSE]
    for profile in profiles:
        args += ["--profile", profile]
    result = subprocess.run([*args, "config"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


@pytest.fixture(scope="module")
def config() -> dict:
    return compose_config("multi-gpu", "pgbouncer")


def test_pgbouncer_is_an_option_for_the_workers():
    """Without the profile the workers talk to PostgreSQL; with it and
    BOXCAR_WORKER_DATABASE_URL they go through PgBouncer in transaction mode, while the API
    and the migrations keep a direct connection."""
    plain = compose_config()
    assert "postgres:5432" in plain["services"]["worker-gpu0"]["environment"][
        "BOXCAR_DATABASE_URL"]
    pooled = compose_config("pgbouncer", env={
        "BOXCAR_WORKER_DATABASE_URL": "postgresql+psycopg://boxcar:boxcar@pgbouncer:6432/boxcar"})
    services = pooled["services"]
    assert services["pgbouncer"]["environment"]["POOL_MODE"] == "transaction"
    assert "pgbouncer:6432" in services["worker-gpu0"]["environment"]["BOXCAR_DATABASE_URL"]
    for direct in ("api", "migrate"):
        assert "postgres:5432" in services[direct]["environment"]["BOXCAR_DATABASE_URL"]


def test_compose_file_is_valid(config):
    services = config["services"]
    assert set(services) == {"api", "worker-gpu0", "worker-gpu1", "redis", "postgres", "s3",
                             "migrate", "model-pull", "pgbouncer"}


def test_every_service_is_checked_and_restarted(config):
    for name, service in config["services"].items():
        if name in ONE_SHOT:
            assert service["restart"] == "on-failure", name
            continue
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        assert service["restart"] == "unless-stopped", name
    for worker in ("worker-gpu0", "worker-gpu1"):
        assert config["services"][worker]["healthcheck"]["test"] == [
            "CMD", "boxcar", "worker", "--healthcheck"]


def test_workers_start_from_the_pulled_model(config):
    services = config["services"]
    for worker in ("worker-gpu0", "worker-gpu1"):
        service = services[worker]
        depends = service["depends_on"]
        for one_shot in ONE_SHOT:
            assert depends[one_shot]["condition"] == "service_completed_successfully"
        for server in ("redis", "s3"):
            assert depends[server]["condition"] == "service_healthy"
        assert "model pull" not in " ".join(service["command"])  # pulled once, not per worker
        assert mounts(service)["/cache"] == "cache"
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"]
    pull = services["model-pull"]
    assert mounts(pull)["/cache"] == "cache"
    assert "boxcar model pull" in " ".join(pull["command"])
    assert services["api"]["depends_on"]["migrate"]["condition"] == (
        "service_completed_successfully")


def test_image_builds_the_gpu_kernels():
    dockerfile = open(os.path.join(REPO, "compose", "Dockerfile")).read()
    assert "ARG BASE_IMAGE=nvidia/cuda:" in dockerfile
    assert "build-essential" in dockerfile and "python3-dev" in dockerfile
    assert "download.pytorch.org/whl/cu" in dockerfile
    for cache in ("BOXCAR_MODEL_CACHE=/cache/", "BOXCAR_CONVERTED_CACHE=/cache/",
                  "BOXCAR_KERNEL_CACHE=/cache/"):
        assert cache in dockerfile
