"""Pretrained starting weights (``--init-weights``): loaded into the global models, and
the payload an edge without private state gets once so its private parts start there
too. Apart from the engine because it is a file format concern, not a round's."""

from __future__ import annotations

from pathlib import Path

import torch

from fedattn_shared.schema import Kind, Payload, Section

INIT_SECTION = "init"


# The file forms --init-weights reads: safetensors (fedattn's, timm's and Hugging Face's
# ``model.safetensors``), and torch's pickled state dicts (torchvision's ``.pth`` files in
# ~/.cache/torch/hub/checkpoints, timm's ``pytorch_model.bin``), read with
# ``weights_only=True`` so that a downloaded file cannot run code.
TORCH_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt")
# Where a training checkpoint keeps its model's state dict.
WRAPPERS = ("state_dict", "model", "model_state_dict")
SHOWN = 5


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a weights file by key (see TORCH_SUFFIXES); StateError naming the file."""
    from fedattn_shared.state import StateError, load_tensors

    if not path.exists():
        raise StateError(f"--init-weights {path}: no such file")
    if path.suffix not in TORCH_SUFFIXES:
        return load_tensors(path)[0]
    try:
        found = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - unpickling raises anything; the file is named
        raise StateError(f"--init-weights {path}: not a torch state dict readable with "
                         f"weights_only=True ({type(err).__name__}: {str(err)[:200]})") from None
    for key in WRAPPERS:
        if isinstance(found, dict) and isinstance(found.get(key), dict):
            found = found[key]
            break
    if not isinstance(found, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in found.items()):
        raise StateError(f"--init-weights {path}: expected a dict of named tensors (a state "
                         f"dict, or one under {'/'.join(WRAPPERS)})")
    return found


def _named(what: str, keys: list[str]) -> str:
    more = f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
    return f"{what}: {keys[:SHOWN]}{more}"


def load_initial_weights(models: dict, path: Path, head: str = "", skip_head: bool = False) -> None:
    """Copy a weights file (``read_weights``) into the models. Keys are ``model/key``
    (qualified) or plain state-dict keys, which then apply to every model of the method;
    every model tensor must be covered, with the same shape, and every file tensor used:
    each mismatch is named (StateError) before any model tensor changes. BatchNorm's
    ``num_batches_tracked`` counters may be absent (older torchvision files). ``head`` is
    the classifier's state-dict prefix; with ``skip_head`` it keeps its fresh seeded
    initialisation and the file's head tensors, of any shape, are ignored (ImageNet
    weights for another number of classes)."""
    from fedattn_shared.state import StateError

    tensors = read_weights(path)

    def in_head(key: str) -> bool:
        key = key.partition("/")[2] if "/" in key else key
        return bool(head) and (key == head or key.startswith(head + "."))

    used = {key for key in tensors if skip_head and in_head(key)}
    missing, shapes, copies = [], [], []
    for name, model in models.items():
        for key, target in model.state_dict(keep_vars=True).items():
            if skip_head and in_head(key):
                continue
            source_key = f"{name}/{key}" if f"{name}/{key}" in tensors else key
            if source_key not in tensors:
                if not key.endswith("num_batches_tracked"):
                    missing.append(f"{name}/{key}")
                continue
            value = tensors[source_key]
            used.add(source_key)
            if tuple(value.shape) != tuple(target.shape):
                hint = (" (the classifier head, for another number of classes? "
                        "--init-skip-head keeps the model's fresh head)") if in_head(key) else ""
                shapes.append(f"{source_key} has shape {list(value.shape)}, the model needs "
                              f"{list(target.shape)}{hint}")
                continue
            copies.append((target, value))
    unused = sorted(set(tensors) - used)
    problems = ([_named("no tensor for", missing)] if missing else []) + shapes[:SHOWN] + (
        [f"{len(shapes) - SHOWN} more shapes differ"] if len(shapes) > SHOWN else []) + (
        [_named("tensors the model does not have", unused)] if unused else [])
    if problems:
        raise StateError(f"--init-weights {path}: " + "; ".join(problems))
    with torch.no_grad():
        for target, value in copies:
            target.copy_(value)


def initial_payload(models: dict, path: str, head: str, skip_head: bool) -> Payload | None:
    """Loads ``path`` (when given) into ``models`` and returns the whole initial models as
    one section, sent once to each edge that joins without private state; None without
    ``--init-weights`` (edges then start from their own seeded models)."""
    if not path:
        return None
    load_initial_weights(models, Path(path), head, skip_head)
    return Payload([Section(Kind.SHARED_TENSORS, INIT_SECTION, {
        f"{name}/{key}": t.detach().clone()
        for name, model in models.items() for key, t in model.state_dict().items()})])
