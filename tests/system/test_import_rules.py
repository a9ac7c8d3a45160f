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


# engine/'s own map: each wing -> the wings it may import (besides itself). "contracts" are the
# torch-free modules at engine/'s top that callers see (protocol, config, params, outputs,
# errors); "front" is the rest of the top (LLMEngine, LLM, start-up), which may import any wing.
CONTRACTS = {"protocol", "config", "sampling_params", "pooling_params", "outputs", "errors"}
MODEL_SIDE = {"layers", "kernels", "contracts"}
ENGINE_WINGS: dict[str, set[str]] = {
    "contracts": set(),
    "kernels": set(),
    "layers": {"kernels"},
    "lora": MODEL_SIDE,
    "models": MODEL_SIDE,
    # the registry (which architectures a checkpoint has); a GGUF tensor kept quantized is
    # handed out packed (kernels' QuantWeight, layers' PackedWeight)
    "checkpoint": {"models"} | MODEL_SIDE,
    "core": {"contracts"},  # scheduler-side bookkeeping never reaches the device side
    "runner": {"core", "models", "lora", "checkpoint"} | MODEL_SIDE,
    "pooling": {"runner", "core", "models", "lora", "checkpoint"} | MODEL_SIDE,
    "distributed": {"runner", "pooling", "core", "models", "lora", "checkpoint"} | MODEL_SIDE,
    "testing": {"contracts", "pooling"},  # the fake engine: torch-free (see below)
    "front": {"contracts", "core", "runner", "pooling", "checkpoint", "lora", "models", "layers",
              "kernels", "distributed", "testing"},
}
# Modules a process without torch imports: the service's side of the seam, and the fake engine
# that 32 scale-bench workers run.
TORCH_FREE = sorted({f"engine.{name}" for name in CONTRACTS} | {
    "engine", "engine.pooling.inputs", "engine.checkpoint.model_cache",
    "engine.testing.fake_engine"})


def engine_wing(module: str) -> str | None:
    """The wing of an ``engine.*`` module (None: not engine's)."""
    parts = module.split(".")
    if parts[0] != "engine":
        return None
    if len(parts) == 1 or not (ROOT / "engine" / parts[1]).is_dir():
        return "contracts" if len(parts) > 1 and parts[1] in CONTRACTS else "front"
    return parts[1]


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports; ``from engine.x import y`` counts ``engine.x.y`` where
    that is a module (or a package) of its own."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            folder = ROOT.joinpath(*node.module.split("."))
            for alias in node.names:
                is_module = ((folder / f"{alias.name}.py").is_file()
                             or (folder / alias.name).is_dir())
                found.add(f"{node.module}.{alias.name}" if is_module else node.module)
    return found


def wing_violations(paths: list[Path]) -> list[str]:
    broken = []
    for path in paths:
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        wing = engine_wing(module)
        assert wing is not None
        for other in {engine_wing(m) for m in imported_modules(path)} - {None, wing}:
            if other not in ENGINE_WINGS[wing]:
                broken.append(f"{path.relative_to(ROOT)} ({wing}) imports {other}")
    return sorted(broken)


def test_engine_wings_import_only_what_their_map_allows() -> None:
    wings = {p.name for p in (ROOT / "engine").iterdir() if (p / "__init__.py").is_file()}
    assert wings | {"contracts", "front"} == set(ENGINE_WINGS), "a wing is missing from the map"
    assert wing_violations(sorted((ROOT / "engine").rglob("*.py"))) == []


def test_the_wing_check_sees_core_reaching_the_runner(tmp_path: Path, monkeypatch) -> None:
    module = ROOT / "engine" / "core" / "scheduler.py"
    assert wing_violations([module]) == []
    fake = tmp_path / "engine" / "core" / "bad.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("from engine.runner.model_runner import ModelRunner\n"
                    "from engine import config\n")
    (tmp_path / "engine" / "config.py").write_text("")
    (tmp_path / "engine" / "runner").mkdir()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert wing_violations([fake]) == ["engine/core/bad.py (core) imports runner"]


def test_the_contracts_and_the_fake_engine_load_without_torch() -> None:
    code = (f"import sys, {', '.join(TORCH_FREE)}; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


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
