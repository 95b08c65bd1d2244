"""Crash-safe files: temp file + fsync + rename, mode 0600, safetensors for tensors.

A kill -9 at any moment leaves either the old file or the new one, never a torn one.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save


class StateError(RuntimeError):
    """A state file that cannot be used; the message names the path."""


def atomic_write(path: str | Path, data: bytes | list, mode: int = 0o600,
                 durable: bool = True) -> None:
    """Temp file + rename: readers see the old or the new file, never a torn one. ``data``
    may be a list of buffers, written in order without joining them.
    ``durable`` adds the fsyncs that make the new file survive a power cut too."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            for part in data if isinstance(data, list) else [data]:
                handle.write(part)
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if not durable:
        return
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write_json(path: str | Path, obj: Any, mode: int = 0o600) -> None:
    atomic_write(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode(), mode)


def read_json(path: str | Path) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise StateError(f"{path}: unreadable or corrupt JSON ({err})") from None


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor],
                 metadata: dict[str, str] | None = None, durable: bool = True) -> None:
    cpu = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    atomic_write(path, st_save(cpu, metadata=metadata or {}), durable=durable)


def load_tensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    path = Path(path)
    try:
        data = path.read_bytes()
        tensors = st_load(data)
        # Metadata from the same bytes (a second open could see a newer file).
        header_len = int.from_bytes(data[:8], "little")
        metadata = json.loads(data[8 : 8 + header_len]).get("__metadata__") or {}
    except FileNotFoundError:
        raise
    except (OSError, SafetensorError, ValueError, UnicodeDecodeError) as err:
        raise StateError(f"{path}: unreadable or corrupt safetensors file ({err})") from None
    return tensors, metadata
