"""The papers' training-recipe pieces: gradient-norm clipping, seeded augmentation on the
edge's training batches (never on evaluation), and input resizing with models built for it."""

from __future__ import annotations

import math

import pytest
import torch

from fedattn_shared.augment import (
    AUGMENTS,
    InputPipeline,
    augment_batch,
    horizontal_flip,
    random_crop,
    random_resized_crop,
    resize,
)
from fedattn_shared.config import ConfigError, TrainConfig, apply_values
from fedattn_shared.data.npz import Split
from fedattn_shared.methods import MethodContext, load_method
from fl_edge.trainer import augment_generator, clip_gradients, evaluate, loader_seed, train_local
from fl_server.cli import build_parser, resolve

CPU = torch.device("cpu")


def make(method="fedavg", **kwargs):
    cls = load_method(method)
    m = cls(MethodContext(TrainConfig(**kwargs), cls.Params()))
    return m, m.edge(m.build_models(), CPU)


def images(n=16, channels=1, size=28, seed=0):
    g = torch.Generator().manual_seed(seed)
    return Split(torch.randn(n, channels, size, size, generator=g),
                 torch.randint(0, 10, (n,), generator=g))


def flat_params(algo):
    return torch.cat([p.detach().flatten().clone() for p in algo.models["model"].parameters()])


def grads_of_one_step(algo, data, batch_size):
    """The gradient of the first (and only) batch, with the model left untouched."""
    model = algo.models["model"]
    model.zero_grad()
    x, y = data.x[:batch_size], data.y[:batch_size]
    algo.training_step((x, y)).backward()
    g = torch.cat([p.grad.flatten().clone() for p in model.parameters()])
    model.zero_grad()
    return g


# ---- gradient-norm clipping ---------------------------------------------------------------

def test_clipped_sgd_step_moves_parameters_by_exactly_the_clipped_gradient():
    """SGD, lr 1, no momentum, one full batch: the move is -g * min(1, C/|g|) exactly."""
    torch.manual_seed(0)
    _, algo = make(lr=1.0)
    algo.train_mode = algo.eval_mode  # BN in eval mode: the gradient does not move BN stats
    data = images(8)
    algo.train_mode()
    g = grads_of_one_step(algo, data, 8)
    norm = float(g.norm())
    clip = norm / 10  # the bound is active
    before = flat_params(algo)
    result = train_local(algo, data, 1, 8, 0, CPU, False, lr=1.0, clip_grad_norm=clip)
    moved = before - flat_params(algo)
    assert result.steps == 1 and result.clipped_steps == 1
    assert result.grad_norm_mean == pytest.approx(norm, rel=1e-5)  # reported before the clip
    assert float(moved.norm()) == pytest.approx(clip, rel=1e-4)
    assert torch.allclose(moved, g * (clip / norm), atol=1e-6)


def test_clip_bound_larger_than_the_gradient_changes_nothing():
    torch.manual_seed(1)
    _, a = make(lr=0.5)
    _, b = make(lr=0.5)
    b.models["model"].load_state_dict(a.models["model"].state_dict())
    for algo in (a, b):
        algo.train_mode = algo.eval_mode
    data = images(8)
    plain = train_local(a, data, 1, 8, 0, CPU, False, lr=0.5)
    loose = train_local(b, data, 1, 8, 0, CPU, False, lr=0.5, clip_grad_norm=1e9)
    assert torch.equal(flat_params(a), flat_params(b))
    assert loose.clipped_steps == 0 and loose.grad_norm_mean > 0
    assert (plain.clipped_steps, plain.grad_norm_mean) == (0, 0.0)  # off: nothing measured


def test_clip_gradients_bounds_the_joint_norm_once_per_parameter():
    w = torch.nn.Parameter(torch.zeros(2))
    w.grad = torch.tensor([3.0, 4.0])  # norm 5
    # Held by two optimizers: clipped once, by the joint norm.
    opts = [torch.optim.SGD([w], lr=1.0), torch.optim.SGD([w], lr=1.0)]
    before = clip_gradients(opts, 1.0)
    assert float(before) == pytest.approx(5.0)
    assert torch.allclose(w.grad, torch.tensor([0.6, 0.8]))


def test_clipping_with_grad_accum_clips_the_accumulated_gradient_once_per_step():
    """Two micro-batches accumulate into one step; the step's move is the clipped mean of
    their gradients, not the mean of each one clipped (which would differ)."""
    torch.manual_seed(2)
    _, algo = make(lr=1.0)
    algo.train_mode = algo.eval_mode
    algo.train_mode()
    data = images(16)
    # The loader shuffles: recover its order to know which samples make each micro-batch.
    order = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    shuffled = Split(data.x[order], data.y[order])
    g1 = grads_of_one_step(algo, shuffled, 8)
    g2 = grads_of_one_step(algo, Split(shuffled.x[8:], shuffled.y[8:]), 8)
    mean = (g1 + g2) / 2
    clip = float(mean.norm()) / 4
    once = mean * (clip / float(mean.norm()))
    each = (g1 * min(1, clip / float(g1.norm())) + g2 * min(1, clip / float(g2.norm()))) / 2
    assert not torch.allclose(once, each, atol=1e-5)  # the test can tell the two apart
    before = flat_params(algo)
    result = train_local(algo, data, 1, 8, 0, CPU, False, lr=1.0, grad_accum=2, clip_grad_norm=clip)
    assert result.steps == 1
    moved = before - flat_params(algo)
    assert torch.allclose(moved, once, atol=1e-5)


def test_clipping_applies_to_every_step_of_a_multi_step_method(monkeypatch):
    """pFedMe takes several optimizer steps per batch; each is clipped (none is lost)."""
    import fl_edge.trainer as trainer

    _, algo = make("pfedme", lr=0.05)
    calls = []
    real = trainer.clip_gradients

    def counting(optimizers, max_norm):  # the real clipping, counted
        norm = real(optimizers, max_norm)
        calls.append(float(norm))
        return norm

    monkeypatch.setattr(trainer, "clip_gradients", counting)
    result = train_local(algo, images(16), 1, 8, 0, CPU, False, clip_grad_norm=0.5)
    assert algo.schedule.steps_per_batch > 1
    assert len(calls) == result.steps == 2 * algo.schedule.steps_per_batch


def test_clipping_refuses_dp_sgd_by_name():
    with pytest.raises(ConfigError, match="clip_grad_norm does not combine with --dp"):
        resolve(build_parser().parse_args(["--dp", "--dp-noise-multiplier", "1.0",
                                           "--model", "gn-resnet-compact",
                                           "--clip-grad-norm", "1.0"]))


def test_under_dp_sgd_per_sample_clipping_is_the_only_clipping_and_augmentation_works():
    """A real Opacus-wrapped edge: train_local refuses a second clipping; augmentation and
    resizing happen before the per-sample gradients, so they combine with DP-SGD."""
    from fedattn_shared.config import DPConfig
    from fedattn_shared.privacy.dp import PrivateTraining

    cls = load_method("fedavg")
    dp = DPConfig(enabled=True, noise_multiplier=1.0, planned_rounds=1)
    method = cls(MethodContext(TrainConfig(model="lenet-bn+gn", image_size=16, input_size=28),
                               cls.Params(), dp=dp))
    algo = method.edge(method.build_models(), CPU)
    data = images(32, size=16)
    privacy = PrivateTraining(algo, dp, len(data), 8)
    with pytest.raises(ValueError, match="clip_grad_norm does not combine with DP-SGD"):
        train_local(algo, data, 1, 8, 0, CPU, False, privacy=privacy, clip_grad_norm=1.0)
    result = train_local(algo, data, 1, 8, 0, CPU, False, privacy=privacy,
                         inputs=InputPipeline("crop-flip", 28))
    assert result.steps >= 1 and math.isfinite(result.mean_loss)


# ---- augmentation --------------------------------------------------------------------------

def known_image():
    """(1, 1, 6, 6) with distinct pixel values 1..36."""
    return torch.arange(1.0, 37.0).view(1, 1, 6, 6)


def test_flip_mirrors_the_chosen_samples_and_nothing_else():
    x = known_image().repeat(64, 1, 1, 1)
    out = horizontal_flip(x, torch.Generator().manual_seed(0))
    flipped = (out != x).flatten(1).any(1)
    assert 10 < int(flipped.sum()) < 54  # about half
    assert torch.equal(out[flipped], x[flipped].flip(-1))
    assert torch.equal(out[~flipped], x[~flipped])


def test_crop_keeps_shape_and_only_moves_pixels():
    x = known_image().repeat(32, 1, 1, 1)
    out = random_crop(x, 2, torch.Generator().manual_seed(0))
    assert out.shape == x.shape
    padded = torch.nn.functional.pad(known_image(), (2, 2, 2, 2))[0, 0]
    offsets = set()
    for sample in out[:, 0]:
        # Each output is exactly one 6x6 window of the zero-padded image.
        hits = [(t, s) for t in range(5) for s in range(5) if torch.equal(padded[t:t + 6, s:s + 6], sample)]
        assert len(hits) == 1
        offsets.add(hits[0])
        assert set(sample[sample != 0].tolist()) <= set(range(1, 37))
    assert len(offsets) > 5  # offsets vary across samples


def test_crop_flip_keeps_shapes_and_values_of_a_known_image():
    x = known_image().repeat(16, 3, 1, 1)  # the same image in 3 channels
    out = augment_batch(x, "crop-flip", torch.Generator().manual_seed(3))
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.equal(out[:, 0], out[:, 1])  # every channel moved alike
    values = set(out.unique().tolist())
    assert values <= set(range(0, 37)) and len(values) > 20


def test_reflect_crop_pads_by_mirroring_the_border_and_adds_no_value():
    x = known_image().repeat(32, 1, 1, 1)
    out = random_crop(x, 2, torch.Generator().manual_seed(0), "reflect")
    assert out.shape == x.shape
    mirrored = torch.nn.functional.pad(known_image(), (2, 2, 2, 2), mode="reflect")[0, 0]
    offsets = set()
    for sample in out[:, 0]:
        hits = [(t, s) for t in range(5) for s in range(5)
                if torch.equal(mirrored[t:t + 6, s:s + 6], sample)]
        assert hits  # a window of the mirrored image
        offsets.add(hits[0])
        assert set(sample.flatten().tolist()) <= set(range(1, 37))  # never a zero: no new value
    assert len(offsets) > 5
    # The same draws as crop-flip: only the padding differs, so an interior pixel agrees.
    zero = augment_batch(x, "crop-flip", torch.Generator().manual_seed(3))
    mirror = augment_batch(x, "crop-flip-reflect", torch.Generator().manual_seed(3))
    inside = (zero != 0)
    assert torch.equal(zero[inside], mirror[inside]) and not torch.equal(zero, mirror)


def test_resized_crop_yields_the_input_size():
    x = torch.randn(5, 3, 32, 32)
    g = torch.Generator().manual_seed(0)
    assert random_resized_crop(x, 64, g).shape == (5, 3, 64, 64)
    assert augment_batch(x, "resized-crop", g).shape == x.shape
    assert augment_batch(x, "resized-crop", g, size=48).shape == (5, 3, 48, 48)


def test_augmentation_is_seeded_per_edge_and_round():
    x = torch.randn(8, 3, 32, 32)
    for recipe in ("crop-flip", "resized-crop"):
        a = augment_batch(x, recipe, augment_generator(loader_seed(0, 1, "edge-a")))
        again = augment_batch(x, recipe, augment_generator(loader_seed(0, 1, "edge-a")))
        later = augment_batch(x, recipe, augment_generator(loader_seed(0, 2, "edge-a")))
        other = augment_batch(x, recipe, augment_generator(loader_seed(0, 1, "edge-b")))
        assert torch.equal(a, again)
        assert not torch.equal(a, later) and not torch.equal(a, other)
    assert augment_batch(x, "none", torch.Generator()) is x
    with pytest.raises(ValueError, match="unknown augmentation 'jitter'"):
        augment_batch(x, "jitter", torch.Generator())


class Spy:
    """Wraps the model and records every batch it is given."""

    def __init__(self, algo):
        self.seen: list[torch.Tensor] = []
        model = algo.models["model"]
        self.handle = model.register_forward_pre_hook(lambda _m, args: self.seen.append(args[0].clone()))


def test_training_batches_are_augmented_and_evaluation_never():
    _, algo = make(lr=0.01)
    data = images(16)
    spy = Spy(algo)
    pipe = InputPipeline("crop-flip")
    train_local(algo, data, 1, 8, 0, CPU, False, inputs=pipe)
    # The loader's order (seed 0): augmented batches differ from the raw ones.
    order = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    raw = data.x[order]
    trained = torch.cat(spy.seen[:2])
    assert trained.shape == raw.shape and not torch.equal(trained, raw)
    # ...and are reproducible: the same seed gives the same batches.
    _, twin = make(lr=0.01)
    twin.models["model"].load_state_dict(algo.models["model"].state_dict())
    spy2 = Spy(twin)
    train_local(twin, data, 1, 8, 0, CPU, False, inputs=pipe)
    assert torch.equal(trained, torch.cat(spy2.seen[:2]))

    def batches_seen(**kwargs):
        _, fresh = make(lr=0.01)
        fresh.models["model"].load_state_dict(twin.models["model"].state_dict())
        seen = Spy(fresh).seen
        train_local(fresh, data, 1, 8, 5, CPU, False, inputs=pipe, **kwargs)
        return torch.cat(seen[:2])

    # By default the stream is augment_generator(seed) (seed: loader_seed of edge and
    # round); a caller may pass its own generator, and another stream gives other batches.
    default = batches_seen()
    assert torch.equal(default, batches_seen(augment_rng=augment_generator(5)))
    assert not torch.equal(default, batches_seen(augment_rng=augment_generator(6)))
    # Evaluation sees the split exactly as stored, in order.
    spy.seen.clear()
    evaluate(algo, data, "test", 10, 8, CPU, pipe)
    assert torch.equal(torch.cat(spy.seen), data.x)


def test_the_end_of_training_statistics_pass_is_not_augmented():
    """Methods' end_train pass (Fed-SAP's statistics) sees the stored data in order."""
    _, algo = make(lr=0.01)
    seen = []
    algo.end_train = lambda batches: seen.extend(x for x, _ in batches)
    data = images(16)
    train_local(algo, data, 1, 8, 0, CPU, False, inputs=InputPipeline("crop-flip"))
    assert torch.equal(torch.cat(seen), data.x)


# ---- input range ---------------------------------------------------------------------------

def test_unit_input_range_maps_training_and_evaluation_batches_to_0_1():
    """train.input_range = unit: every batch the model sees is (x + 1) / 2 of the stored
    [-1, 1] images, after augmentation in training, and in evaluation (never augmented)."""
    _, algo = make(lr=0.01)
    data = Split(torch.rand(16, 1, 28, 28) * 2 - 1, torch.randint(0, 10, (16,)))
    spy = Spy(algo)
    unit = InputPipeline(input_range="unit")
    assert not unit.identity and InputPipeline().identity
    train_local(algo, data, 1, 8, 0, CPU, False, inputs=unit)
    trained = torch.cat(spy.seen[:2])  # the epoch's two batches, in the loader's order
    expected = data.x * 0.5 + 0.5
    by_sum = lambda t: t[t.flatten(1).sum(1).argsort()]  # noqa: E731
    assert torch.allclose(by_sum(trained), by_sum(expected))
    assert trained.min() >= 0 and trained.max() <= 1
    spy.seen.clear()
    evaluate(algo, data, "test", 10, 8, CPU, unit)
    assert torch.equal(torch.cat(spy.seen), data.x * 0.5 + 0.5)
    # uint8 images decoded as v / 255 up to float rounding
    v = torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16)
    from fedattn_shared.data.npz import decode_images
    assert torch.allclose(unit.eval_batch(decode_images(v)), v.float() / 255, atol=1e-6)
    # With a crop, the zero padding lands on the grey 0.5 of the unit range.
    padded = InputPipeline("crop-flip", input_range="unit").train_batch(
        torch.full((64, 1, 8, 8), -1.0), torch.Generator().manual_seed(0))
    assert set(padded.unique().tolist()) == {0.0, 0.5}


def test_imagenet_input_range_standardises_each_channel_as_torchvision_does():
    torchvision = pytest.importorskip("torchvision")
    v = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    from fedattn_shared.data.npz import decode_images
    ours = InputPipeline(input_range="imagenet").eval_batch(decode_images(v))
    normalize = torchvision.transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    assert torch.allclose(ours, normalize(v.float() / 255), atol=1e-5)
    with pytest.raises(ConfigError, match=r"train\.input_range imagenet .*train\.in_channels 1"):
        TrainConfig(input_range="imagenet", in_channels=1).validate()
    TrainConfig(input_range="imagenet", in_channels=3).validate()


def test_the_run_pipeline_is_built_from_train_in_one_place():
    train = TrainConfig(augment="crop-flip-reflect", input_size=40, input_range="unit")
    assert InputPipeline.of(train) == InputPipeline("crop-flip-reflect", 40, "unit")
    with pytest.raises(ConfigError, match=r"train\.input_range"):
        TrainConfig(input_range="imagenet").validate()


def test_offline_predict_uses_the_run_input_range():
    from fl_edge.export import Personalized, predict

    method, algo = make(model="lenet-bn", input_range="unit")
    algo.eval_mode()
    model = Personalized(method, algo, method.train, "{}", "")
    x = images(5).x.clamp(-1, 1)
    with torch.no_grad():
        expected = algo.predict(x * 0.5 + 0.5).float().softmax(dim=1)
        plain = algo.predict(x).float().softmax(dim=1)
    assert torch.allclose(predict(model, x), expected) and not torch.allclose(expected, plain)


# ---- input size ----------------------------------------------------------------------------

def test_resize_is_bilinear_antialiased_and_a_no_op_at_the_same_size():
    x = torch.randn(2, 3, 32, 32)
    assert resize(x, 0) is x and resize(x, 32) is x
    big = resize(x, 64)
    assert big.shape == (2, 3, 64, 64)
    assert torch.allclose(resize(torch.ones(1, 1, 32, 32), 64), torch.ones(1, 1, 64, 64))


def test_input_size_resizes_in_training_and_evaluation_and_fingerprints_match():
    method, algo = make(model="lenet-bn", image_size=16, input_size=28, lr=0.01)
    spy = Spy(algo)
    data = images(16, size=16)
    pipe = InputPipeline(input_size=28)
    train_local(algo, data, 1, 8, 0, CPU, False, inputs=pipe)
    assert {tuple(x.shape[-2:]) for x in spy.seen} == {(28, 28)}
    spy.seen.clear()
    counts = evaluate(algo, data, "test", 10, 8, CPU, pipe)
    assert counts.total == 16 and {tuple(x.shape[-2:]) for x in spy.seen} == {(28, 28)}
    # The server resolves the same [train] and builds the same models: same fingerprint,
    # which is the fingerprint of a model built for 28 px.
    server, train, server_method = resolve(build_parser().parse_args(
        ["--image-size", "16", "--input-size", "28", "--model", "lenet-bn"]))
    assert train.model_size == 28
    fp = server_method.fingerprint(server_method.build_models())
    assert fp == method.fingerprint(method.build_models())
    native, _ = make(model="lenet-bn", image_size=28)
    assert fp == native.fingerprint(native.build_models())


def test_mobilenet_v3_small_at_input_64_on_32px_data_trains_and_keeps_a_spatial_map():
    method, algo = make(model="mobilenet-v3-small", in_channels=3, image_size=32, input_size=64,
                        lr=0.01)
    model = algo.models["model"]
    maps = []
    model.features.register_forward_hook(lambda _m, _a, out: maps.append(tuple(out.shape[-2:])))
    data = images(8, channels=3, size=32)
    result = train_local(algo, data, 1, 4, 0, CPU, False, inputs=InputPipeline("crop-flip", 64))
    assert result.steps == 2 and math.isfinite(result.mean_loss)
    assert maps[0] == (2, 2)  # at 32 px it would be 1x1
    _, small = make(model="mobilenet-v3-small", in_channels=3, image_size=32)
    small.models["model"].features.register_forward_hook(
        lambda _m, _a, out: maps.append(tuple(out.shape[-2:])))
    evaluate(small, data, "test", 10, 8, CPU)
    assert maps[-1] == (1, 1)


def test_offline_predict_resizes_to_the_run_input_size():
    from fl_edge.export import Personalized, predict

    method, algo = make(model="lenet-bn", image_size=16, input_size=28)
    algo.eval_mode()
    model = Personalized(method, algo, method.train, "{}", "")
    probs = predict(model, images(5, size=16).x)
    assert probs.shape == (5, 10) and torch.allclose(probs.sum(1), torch.ones(5))


# ---- configuration and flags ---------------------------------------------------------------

@pytest.mark.parametrize("values, key", [
    ({"clip_grad_norm": -1.0}, "train.clip_grad_norm"),
    ({"clip_grad_norm": math.inf}, "train.clip_grad_norm"),
    ({"input_size": -2}, "train.input_size"),
])
def test_validation_refuses_bad_values_by_name(values, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        TrainConfig(**values).validate()


def test_augment_is_checked_against_its_names():
    train = TrainConfig()
    with pytest.raises(ConfigError,
                       match=r"train\.augment: 'flip' is not one of none, crop-flip, "
                             r"crop-flip-reflect, resized-crop"):
        apply_values(train, "train", {"augment": "flip"}, "run.toml")
    with pytest.raises(ConfigError, match=r"train\.augment"):
        TrainConfig(augment="cutout").validate()
    assert set(AUGMENTS) == {"none", "crop-flip", "crop-flip-reflect", "resized-crop"}


def test_flags_reach_train():
    _, train, _ = resolve(build_parser().parse_args(
        ["--clip-grad-norm", "1.0", "--augment", "crop-flip", "--input-size", "64",
         "--model", "mobilenet-v3-small", "--in-channels", "3", "--image-size", "32"]))
    assert (train.clip_grad_norm, train.augment, train.input_size) == (1.0, "crop-flip", 64)
    _, train, _ = resolve(build_parser().parse_args(["--set", 'train.augment="resized-crop"']))
    assert train.augment == "resized-crop"
    _, train, _ = resolve(build_parser().parse_args(
        ["--augment", "crop-flip-reflect", "--input-range", "unit"]))
    assert (train.augment, train.input_range) == ("crop-flip-reflect", "unit")
    assert TrainConfig().input_range == "symmetric"
    defaults = TrainConfig()
    assert (defaults.clip_grad_norm, defaults.augment, defaults.input_size) == (0.0, "none", 0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--augment", "mixup"])


# ---- end to end ----------------------------------------------------------------------------

def test_recipe_flags_reach_real_edges_which_train_and_evaluate_with_them(cluster, tmp_path):
    """fl-server sends the recipe in [train]; each fl-edge builds the model for input_size
    (its fingerprint must equal the server's, or it exits 2), trains with clipping and
    crop-flip, and evaluates at the resized input."""
    from conftest import read_history, write_edge_dirs

    dirs = write_edge_dirs(tmp_path, 2, per_edge=60)
    server = cluster.server("--method", "fedavg", "--rounds", "1", "--min-edges", "2",
                            "--clip-grad-norm", "1.0", "--augment", "crop-flip",
                            "--input-size", "32")
    edges = [cluster.edge(d, f"r{i}") for i, d in enumerate(dirs)]
    assert [e.wait() for e in edges] == [0, 0]
    assert server.wait() == 0
    history = read_history(tmp_path / "server-state")
    train = history["manifest"]["train"]
    assert (train["clip_grad_norm"], train["augment"], train["input_size"]) == (1.0, "crop-flip", 32)
    (record,) = history["rounds"]
    assert record["train"]["received"] == ["r0", "r1"]
    for figures in record["evaluation"]["per_edge"].values():
        assert figures["test"]["n"] > 0
    for figures in record["train"]["edge_metrics"].values():  # the clip reports its figures
        assert figures["grad_norm"] > 0 and 0 <= figures["clipped_fraction"] <= 1
