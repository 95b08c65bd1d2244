"""``fl-edge export`` and ``fl-edge predict``: the personalized model, offline.

The personalized model is exactly what evaluation scores: the edge's private state plus
the last global downlink it received, passed through the method's own ``receive`` and
``predict``. Export writes every model of the method into one safetensors file with the
run configuration in its metadata; predict rebuilds it from either a state dir or an
exported file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedattn_shared.augment import InputPipeline
from fedattn_shared.config import ConfigError, TrainConfig, apply_values
from fedattn_shared.methods import load_method
from fedattn_shared.methods.base import EdgeAlgorithm, Method, MethodContext
from fedattn_shared.runconfig import RunConfig
from fedattn_shared.schema import EVALUATE, Payload
from fedattn_shared.state import StateError, load_tensors, save_tensors

from .store import PrivateStore

EXPORT_FORMAT = "fedattn-personalized-model/1"


@dataclass
class Personalized:
    """The personalized model of an edge, loaded for scoring outside a run (export,
    predict): the method and algorithm as the run built them, with their state."""
    method: Method
    algo: EdgeAlgorithm
    train: TrainConfig
    config_json: str
    fingerprint: str


def build(config_json: str, device: torch.device) -> tuple[Method, EdgeAlgorithm, TrainConfig, str]:
    """Rebuilds the run's method and models from a stored run config, as the edge did
    (no server); returns the fingerprint the caller checks against the stored one.
    StateError names a stored config this fedattn cannot read."""
    try:
        config = RunConfig.from_json(config_json, source="stored run config")
        cls = load_method(config.method)
        params = cls.Params()
        apply_values(params, config.method, dict(config.params), "stored run config")
    except (ConfigError, ValueError) as err:  # RunConfigError is a ValueError
        raise StateError(f"stored run config: {err}") from None
    method = cls(MethodContext(config.train, params))
    models = method.build_models()
    return method, method.edge(models, device), config.train, method.fingerprint(models)


CPU = torch.device("cpu")


def from_state_dir(state_dir: Path, device: torch.device = CPU) -> Personalized:
    """The edge's model as its last round left it: private state plus the last global,
    refused when the state dir was written by another model."""
    store = PrivateStore(state_dir)
    config_json, fingerprint = store.load_run_config()
    method, algo, train, built = build(config_json, device)
    if built != fingerprint:
        raise StateError(f"{store.config_path}: fingerprint {fingerprint} does not match the "
                         f"model this fedattn builds ({built})")
    if not store.exists():
        raise StateError(f"{store.path}: missing; the edge has not trained yet")
    store.load(algo, fingerprint)
    algo.receive(EVALUATE, store.load_global(), Payload())
    algo.eval_mode()
    return Personalized(method, algo, train, config_json, fingerprint)


def export(state_dir: Path, out: Path) -> Personalized:
    """Writes the personalized model to one safetensors file, with the config that rebuilds
    it, so it can be scored without the state dir."""
    model = from_state_dir(state_dir)
    tensors = {f"{name}/{key}": value for name, m in model.algo.models.items()
               for key, value in m.state_dict().items()}
    save_tensors(out, tensors, {"format": EXPORT_FORMAT, "config": model.config_json,
                                "fingerprint": model.fingerprint,
                                "classes": json.dumps(model.train.classes)})
    return model


def from_export(path: Path, device: torch.device = CPU) -> Personalized:
    """Loads a file ``export`` wrote, refusing one this fedattn builds another model for."""
    tensors, meta = load_tensors(path)
    if meta.get("format") != EXPORT_FORMAT:
        raise StateError(f"{path}: not a fedattn exported model")
    method, algo, train, fingerprint = build(meta["config"], device)
    if fingerprint != meta.get("fingerprint"):
        raise StateError(f"{path}: fingerprint does not match the model this fedattn builds")
    with torch.no_grad():
        for name, model in algo.models.items():
            for key, target in model.state_dict(keep_vars=True).items():
                target.copy_(tensors[f"{name}/{key}"])
    algo.eval_mode()
    return Personalized(method, algo, train, meta["config"], fingerprint)


def load_images(paths: list[Path], train: TrainConfig) -> torch.Tensor:
    """Image files -> normalised (N, C, H, W), as the training data is."""
    from PIL import Image, UnidentifiedImageError

    arrays = []
    for path in paths:
        try:
            with Image.open(path) as image:
                image = image.convert("L" if train.in_channels == 1 else "RGB")
                array = np.asarray(image, dtype=np.uint8)
        except (OSError, UnidentifiedImageError) as err:
            raise StateError(f"{path}: unreadable image ({err})") from None
        if array.shape[:2] != (train.image_size, train.image_size):
            raise StateError(f"{path}: image is {array.shape[1]}x{array.shape[0]}, the model "
                             f"expects {train.image_size}x{train.image_size}")
        arrays.append(array if array.ndim == 3 else array[:, :, None])
    x = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float()
    return x.div_(255.0).sub_(0.5).div_(0.5)


@torch.no_grad()
def predict(model: Personalized, x: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    """Class probabilities (N, classes); images go through the run's evaluation pipeline
    (resized to train.input_size, mapped to train.input_range) as in evaluation."""
    inputs = InputPipeline.of(model.train)
    out = [model.algo.predict(inputs.eval_batch(x[i : i + batch_size])).float().softmax(dim=1)
           for i in range(0, len(x), batch_size)]
    return torch.cat(out) if out else torch.empty(0, model.train.num_classes)
