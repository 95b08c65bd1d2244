"""The reproduction's own code on this machine's data: what does it score here?

Why: ``bench/calibrate.py`` runs Flower's NIID-Bench protocol through fl-sim, and every
Dirichlet row lands 3-5 points above the published table while the IID row lands within
2. Each difference named so far between the system and the reproduction was tested and
ruled out (input pipeline, test subset, partition). The remaining question is whether the
reproduction's code itself reaches its published figures. This script answers it without
copying that code: it imports the ``niid_bench`` package from a Flower checkout given on
the command line and runs its pieces as its ``main.py`` wires them, with only the data
source and the simulation layer replaced:

  * data: ``dataset_preparation.CIFAR10`` (torchvision's class, which would download) is
    replaced by a class of the same interface over the CIFAR-10 binary files here
    (PIL images through the reproduction's own transforms, ``targets`` a list); the
    partition is its ``partition_data_dirichlet`` / ``partition_data`` with its default
    seed 42, the loaders its ``load_datasets`` would build (batch 64, shuffled,
    ``val_split`` 0);
  * training: its ``models.CNN`` and ``train_fedavg`` / ``train_fedprox`` (a new SGD
    each round, lr 0.01, momentum 0.9, weight decay 1e-5, 10 epochs), every client every
    round, the client's model set from the global as its ``set_parameters`` does;
  * aggregation: Flower's FedAvg ``aggregate`` (the weighted mean of the clients' float32
    arrays, weights the clients' example counts), written out here because flwr is not
    installed; Flower's simulation layer (Ray actors) is not run: it moves the same arrays;
  * evaluation: its ``models.test`` on the 860 images ``bench/calibrate.py`` scores (the
    first 86 of each class of the 1,000 official test records here) and on all 1,000.

Torch's RNG (the loaders' shuffles and the crop/flip draws; the reproduction never seeds
it) is seeded with ``--seed``; every round's state is checkpointed, so a stopped run
resumes with the same command and ends bit-identical to one never stopped.

    git --git-dir=FLOWER.git archive HEAD baselines/niid_bench | tar -x -C /tmp/flower
    OMP_NUM_THREADS=1 .venv/bin/python bench/niid_bench_reference.py \\
        --niid-bench /tmp/flower/baselines/niid_bench --out /work/niid-ref --seed 0
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

import numpy as np
import torch
from _harness import SHARED_DATA

CIFAR10_BIN = SHARED_DATA / "cifar-10" / "cifar-10-batches-bin"
CLIENTS, ROUNDS, EPOCHS, BATCH = 10, 50, 10, 64
LR, MOMENTUM, WEIGHT_DECAY = 0.01, 0.9, 1e-5
TEST_PER_CLASS = 86


def cifar10_class(files: Path, limit: int = 0) -> type:
    """A stand-in for ``torchvision.datasets.CIFAR10`` over the CIFAR-10 files in ``files``
    (read once, by fl-partition's reader): the same constructor (its ``root`` unused),
    ``data`` (uint8, N x 32 x 32 x 3), ``targets`` (a list) and ``__getitem__`` (a PIL
    image through ``transform``), no download. ``limit``: the first N training images."""
    from PIL import Image

    from fedattn_shared.data.sources import load_source

    source = load_source(files)

    class LocalCIFAR10(torch.utils.data.Dataset):
        def __init__(self, root: str = "data", train: bool = True,
                     download: bool = False, transform=None, target_transform=None):
            x, y = (source.train_x, source.train_y) if train else (source.test_x, source.test_y)
            if train and limit:
                x, y = x[:limit], y[:limit]
            self.data, self.targets = x, y.astype(np.int64).tolist()
            self.transform, self.target_transform = transform, target_transform

        def __len__(self) -> int:
            return len(self.targets)

        def __getitem__(self, index: int):
            img, target = Image.fromarray(self.data[index]), self.targets[index]
            if self.transform is not None:
                img = self.transform(img)
            if self.target_transform is not None:
                target = self.target_transform(target)
            return img, target

    return LocalCIFAR10


def aggregate(results: list[tuple[list[np.ndarray], int]]) -> list[np.ndarray]:
    """Flower's FedAvg ``aggregate``: per layer, sum_k n_k * w_k / sum_k n_k."""
    total = sum(n for _, n in results)
    weighted = [[layer * n for layer in weights] for weights, n in results]
    return [sum(layers[1:], layers[0]) / total for layers in zip(*weighted, strict=True)]


def get_parameters(net: torch.nn.Module) -> list[np.ndarray]:
    return [v.cpu().numpy() for v in net.state_dict().values()]


def set_parameters(net: torch.nn.Module, parameters: list[np.ndarray]) -> None:
    keys = net.state_dict().keys()
    net.load_state_dict({k: torch.Tensor(v) for k, v in zip(keys, parameters, strict=True)},
                        strict=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--niid-bench", type=Path, required=True,
                   help="a Flower checkout's baselines/niid_bench (holds the niid_bench package)")
    p.add_argument("--out", type=Path, required=True, help="checkpoint and per-round log")
    p.add_argument("--seed", type=int, default=0, help="torch's RNG (the partition keeps 42)")
    p.add_argument("--partition", choices=["dirichlet", "iid"], default="dirichlet")
    p.add_argument("--algorithm", choices=["fedavg", "fedprox"], default="fedavg")
    p.add_argument("--mu", type=float, default=0.01)
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--limit", type=int, default=0, help=argparse.SUPPRESS)  # tests: N images
    p.add_argument("--epochs", type=int, default=EPOCHS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not CIFAR10_BIN.exists():
        print(f"no CIFAR-10 at {CIFAR10_BIN} (set FEDATTN_DATA)", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    sys.path.insert(0, str(args.niid_bench.resolve()))
    prep = importlib.import_module("niid_bench.dataset_preparation")
    models = importlib.import_module("niid_bench.models")
    prep.CIFAR10 = cifar10_class(CIFAR10_BIN, args.limit)
    if args.partition == "dirichlet":
        datasets, testset = prep.partition_data_dirichlet(CLIENTS, alpha=0.5, seed=42,
                                                          dataset_name="cifar10")
    else:
        datasets, testset = prep.partition_data(CLIENTS, similarity=1.0, seed=42,
                                                dataset_name="cifar10")
    # The calibration's 860: fl-partition's select_global_test takes the first 86 test
    # records of each class (it returns arrays; the reference needs their indices).
    picked = [i for c in range(10)
              for i in [j for j, t in enumerate(testset.targets) if t == c][:TEST_PER_CLASS]]
    test_loaders = {"860": torch.utils.data.DataLoader(torch.utils.data.Subset(testset, picked),
                                                       batch_size=len(picked)),
                    "all": torch.utils.data.DataLoader(testset, batch_size=len(testset))}

    def new_net() -> torch.nn.Module:
        return models.CNN(input_dim=400, hidden_dims=[120, 84], num_classes=10)

    # load_datasets: random_split(dataset, [n, 0], Generator().manual_seed(42)), then a
    # shuffled loader of batch 64 per client; the split draws from its own generator.
    datasets = [torch.utils.data.random_split(d, [len(d), 0], torch.Generator().manual_seed(42))[0]
                for d in datasets]
    loaders = [torch.utils.data.DataLoader(d, batch_size=BATCH, shuffle=True) for d in datasets]
    args.out.mkdir(parents=True, exist_ok=True)
    state_file, log = args.out / "state.pt", args.out / "rounds.tsv"
    if state_file.exists():
        # The loaders' shuffles and the augmentation draw from torch's RNG only: restored,
        # the resumed rounds draw what an unstopped run would.
        state = torch.load(state_file, weights_only=False)
        torch.set_rng_state(state["rng"])
        first, params = state["round"] + 1, state["params"]
        print(f"resuming after round {state['round']}")
    else:
        torch.manual_seed(args.seed)
        params = get_parameters(new_net())  # Flower's initial global: one client's init
        first = 1
        log.write_text("round\tacc_860\tacc_1000\tseconds\n")
    print(f"clients: {[len(d) for d in datasets]}; test: {len(picked)} / {len(testset)}")
    device = torch.device("cpu")
    for rnd in range(first, args.rounds + 1):
        start = time.monotonic()
        results = []
        for loader in loaders:
            net = new_net()
            set_parameters(net, params)
            if args.algorithm == "fedavg":
                models.train_fedavg(net, loader, device, args.epochs, LR, MOMENTUM, WEIGHT_DECAY)
            else:
                models.train_fedprox(net, loader, device, args.epochs, args.mu, LR, MOMENTUM,
                                     WEIGHT_DECAY)
            results.append((get_parameters(net), len(loader.dataset)))
        params = aggregate(results)
        net = new_net()
        set_parameters(net, params)
        accs = {k: 100.0 * models.test(net, dl, device)[1] for k, dl in test_loaders.items()}
        seconds = time.monotonic() - start
        torch.save({"round": rnd, "params": params, "rng": torch.get_rng_state()},
                   state_file.with_suffix(".tmp"))
        state_file.with_suffix(".tmp").replace(state_file)
        with log.open("a") as f:
            f.write(f"{rnd}\t{accs['860']:.2f}\t{accs['all']:.2f}\t{seconds:.1f}\n")
        print(f"round {rnd}: {accs['860']:.2f} % on 860, {accs['all']:.2f} % on 1000 "
              f"({seconds:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
