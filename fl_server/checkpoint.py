"""Server checkpoints: one directory per completed round plus an atomically replaced
manifest that names the latest one. A crash at any moment leaves the previous round
loadable; directories newer than the manifest are half-written and are removed."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from fedattn_shared.state import (
    StateError,
    atomic_write_json,
    load_tensors,
    read_json,
    save_tensors,
)

FORMAT = "fedattn-server-checkpoint/1"
# The tensors file of the last pruned round, overwritten in place by the next checkpoint
# instead of a fresh file (see save_tensors). No manifest ever names it.
SPARE = ".spare.safetensors"


class CheckpointStore:
    """The checkpoint directory of one run: ``keep`` rounds are kept, older ones pruned
    (their tensors file recycled as the next write's, see ``SPARE``)."""
    def __init__(self, root: Path, keep: int = 2):
        self.root = Path(root)
        self.keep = max(1, keep)
        self.manifest_path = self.root / "manifest.json"

    def rounds_dir(self) -> Path:
        """Where the per-round directories live."""
        return self.root / "rounds"

    def latest(self) -> dict[str, Any] | None:
        """The manifest naming the latest complete round, or None for a fresh directory."""
        if not self.manifest_path.exists():
            return None
        manifest = read_json(self.manifest_path)
        if manifest.get("format") != FORMAT:
            raise StateError(f"{self.manifest_path}: not a fedattn server checkpoint manifest")
        return manifest

    def save(self, round_number: int, tensors: dict[str, torch.Tensor], state: dict) -> Path:
        """Writes one round (tensors, then state, then the manifest that makes it the
        latest) and prunes old rounds."""
        directory = self.rounds_dir() / f"{round_number:06d}"
        directory.mkdir(parents=True, exist_ok=True)
        save_tensors(directory / "state.safetensors", tensors,
                     recycle=self.rounds_dir() / SPARE)
        atomic_write_json(directory / "state.json", state)
        atomic_write_json(self.manifest_path, {"format": FORMAT, "round": round_number,
                                               "dir": str(directory.relative_to(self.root))})
        self._prune(round_number)
        return directory

    def load(self) -> tuple[int, dict[str, torch.Tensor], dict]:
        """The latest round (number, tensors, state); removes half-written newer rounds."""
        manifest = self.latest()
        if manifest is None:
            raise StateError(f"{self.root}: no checkpoint to resume from")
        directory = self.root / manifest["dir"]
        try:
            tensors, _ = load_tensors(directory / "state.safetensors")
            state = read_json(directory / "state.json")
        except FileNotFoundError as err:
            raise StateError(f"{directory}: checkpoint named by the manifest is missing "
                             f"({err.filename})") from None
        self._remove_newer(int(manifest["round"]))
        return int(manifest["round"]), tensors, state

    def _round_dirs(self) -> list[tuple[int, Path]]:
        if not self.rounds_dir().is_dir():
            return []
        return sorted((int(p.name), p) for p in self.rounds_dir().iterdir() if p.name.isdigit())

    def _remove_newer(self, round_number: int) -> None:
        for number, path in self._round_dirs():
            if number > round_number:
                shutil.rmtree(path, ignore_errors=True)

    def _prune(self, latest: int) -> None:
        dirs = [(n, p) for n, p in self._round_dirs() if n <= latest]
        for _, path in dirs[: -self.keep]:
            try:
                os.replace(path / "state.safetensors", self.rounds_dir() / SPARE)
            except OSError:
                pass
            shutil.rmtree(path, ignore_errors=True)
