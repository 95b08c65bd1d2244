"""Crash-safe files: temp file + fsync + rename, mode 0600, safetensors for tensors.

A kill -9 at any moment leaves either the old file or the new one, never a torn one.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save_file as st_save_file


class StateError(RuntimeError):
    """A state file that cannot be used; the message names the path."""


def atomic_write(path: str | Path, data: bytes | list, mode: int = 0o600,
                 durable: bool = True) -> None:
    """Temp file + rename: readers see the old or the new file, never a torn one. ``data``
    may be a list of buffers, written in order without joining them.
    ``durable`` adds the fsyncs that make the new file survive a power cut too."""

    def fill(tmp: str) -> None:
        with open(tmp, "wb") as handle:
            for part in data if isinstance(data, list) else [data]:
                handle.write(part)

    atomic_fill(path, fill, mode, durable)


def atomic_fill(path: str | Path, fill: Callable[[str], None], mode: int = 0o600,
                durable: bool = True) -> None:
    """``atomic_write`` for a writer that takes a file name: ``fill(tmp)`` writes the
    temp file, which then replaces ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        fill(tmp)
        if durable:
            _fsync(tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if durable:
        _fsync(path.parent)


def _fsync(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    """Streamed into the file by safetensors, without a copy of the whole file in memory."""
    seen: set[int] = set()
    owned = {k: _owning(v, seen) for k, v in tensors.items()}
    atomic_fill(path, lambda tmp: st_save_file(owned, tmp, metadata=metadata or {}),
                durable=durable)


def _owning(tensor: torch.Tensor, seen: set[int]) -> torch.Tensor:
    """The tensor on the CPU, copied only when it is a view into a larger buffer or shares
    memory with one already taken (safetensors refuses both)."""
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.numel() == 0:
        return tensor
    whole = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    if not whole or tensor.data_ptr() in seen:
        tensor = tensor.clone()
    seen.add(tensor.data_ptr())
    return tensor


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
