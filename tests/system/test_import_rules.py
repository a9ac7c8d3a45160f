"""The module map of the README, enforced: which top-level package may import which, read from
every module's import statements (lazy imports inside functions count too)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Folder -> the boxcar packages it may import (besides itself). The README's table.
ALLOWED = {
    "engine": set(),
    "openai_format": set(),
    "pipeline": {"engine", "openai_format"},
    "service": {"openai_format"},
    "metrics": {"engine", "service"},  # engine: its contracts (protocol, outputs), for types
    "api": {"service", "openai_format", "metrics"},
    "worker": {"engine", "pipeline", "service", "openai_format", "metrics"},
    "cli": {"engine", "pipeline", "service", "openai_format", "metrics", "api", "worker"},
    "bench": {"engine", "pipeline", "service", "openai_format", "metrics", "api", "worker",
              "cli"},
}


def imported_packages(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & set(ALLOWED)


def test_every_package_imports_only_what_the_module_map_allows() -> None:
    broken = []
    for package, allowed in ALLOWED.items():
        files = sorted((ROOT / package).rglob("*.py"))
        assert files, f"{package}/ has no modules"
        for path in files:
            for other in imported_packages(path) - allowed - {package}:
                broken.append(f"{path.relative_to(ROOT)} imports {other}")
    assert broken == []


def test_the_rule_check_sees_a_forbidden_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from worker.drain import Drainer\n")
    assert imported_packages(module) == {"worker"}


def test_boxcar_run_loads_the_openai_format_without_the_service_core() -> None:
    code = ("import sys, cli.main, cli.offline, metrics.recorder; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('service', 'api', 'worker', 'sqlalchemy', 'celery')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_a_worker_loads_torch_only_with_its_engine() -> None:
    # A worker process with a fake engine (bench/scale.py starts 32 of them) stays small.
    code = ("import sys, cli.main, worker.celery_app, worker.process, pipeline.engine_adapter; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"
