"""A worker's LoRA adapters: ``lora_modules`` entries whose PATH is an object-storage key.

``NAME=PATH`` with PATH a local folder is handed to the engine as is. Any other PATH is the key
prefix of a PEFT folder in the deployment's object storage (``PATH/adapter_config.json``,
``PATH/adapter_model.safetensors``): the worker downloads it once into
``$BOXCAR_LORA_CACHE`` (default ``~/.cache/boxcar/lora``), one folder per key, and later starts
read that folder. Each file is written under a temporary name and renamed when complete, so a
worker killed mid-download leaves no half file that looks whole.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from service.storage import ObjectStorage

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def lora_cache_dir() -> Path:
    configured = os.environ.get("BOXCAR_LORA_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "boxcar" / "lora"


def local_lora_modules(entries: list[str], storage: ObjectStorage,
                       cache_dir: Path | None = None) -> list[str]:
    """``entries`` with every object-storage PATH replaced by its downloaded folder. A key that
    is not in the storage raises ValueError naming the adapter."""
    cache_dir = cache_dir or lora_cache_dir()
    resolved = []
    for entry in entries:
        name, sep, path = entry.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path or os.path.isdir(path):
            resolved.append(entry)  # the engine checks (and names) what is wrong with it
            continue
        folder = cache_dir / hashlib.sha256(path.encode()).hexdigest()[:24]
        for file_name in ADAPTER_FILES:
            target = folder / file_name
            if target.is_file():
                continue
            key = f"{path.rstrip('/')}/{file_name}"
            if not storage.exists(key):
                raise ValueError(f"LoRA adapter {name!r}: {path!r} is neither a local folder "
                                 f"nor an object-storage key prefix holding {file_name}")
            folder.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{file_name}.{os.getpid()}.part")
            with open(partial, "wb") as f:
                for chunk in storage.iter_chunks(key):
                    f.write(chunk)
            partial.replace(target)
        resolved.append(f"{name}={folder}")
    return resolved
