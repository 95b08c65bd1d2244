"""Pretrained starting weights (``--init-weights``): loaded into the global models, and
the payload an edge without private state gets once so its private parts start there
too. Apart from the engine because it is a file format concern, not a round's."""

from __future__ import annotations

from pathlib import Path

import torch

from fedattn_shared.schema import Kind, Payload, Section

INIT_SECTION = "init"


def load_initial_weights(models: dict, path: Path, head: str = "", skip_head: bool = False) -> None:
    """Copy a safetensors file into the models. Keys are ``model/key`` (qualified) or plain
    state-dict keys, which then apply to every model of the method; every model tensor
    must be covered, with the same shape. ``head`` is the classifier's state-dict prefix;
    with ``skip_head`` it keeps its fresh seeded initialisation and the file's head
    tensors, of any shape, are ignored (ImageNet weights for another number of classes)."""
    from fedattn_shared.state import StateError, load_tensors

    if not path.exists():
        raise StateError(f"--init-weights {path}: no such file")
    tensors, _ = load_tensors(path)

    def in_head(key: str) -> bool:
        key = key.partition("/")[2] if "/" in key else key
        return bool(head) and (key == head or key.startswith(head + "."))

    used = {key for key in tensors if skip_head and in_head(key)}
    with torch.no_grad():
        for name, model in models.items():
            for key, target in model.state_dict(keep_vars=True).items():
                if skip_head and in_head(key):
                    continue
                source_key = f"{name}/{key}" if f"{name}/{key}" in tensors else key
                if source_key not in tensors:
                    raise StateError(f"--init-weights {path}: no tensor for {name}/{key}")
                value = tensors[source_key]
                if tuple(value.shape) != tuple(target.shape):
                    hint = (" (the classifier head, for another number of classes? "
                            "--init-skip-head keeps the model's fresh head)") if in_head(key) else ""
                    raise StateError(f"--init-weights {path}: {source_key} has shape "
                                     f"{list(value.shape)}, the model needs {list(target.shape)}"
                                     + hint)
                target.copy_(value)
                used.add(source_key)
    unused = sorted(set(tensors) - used)
    if unused:
        raise StateError(f"--init-weights {path}: tensors the model does not have: {unused[:5]}")


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
