"""The Python steps of bench/gpu_check.sh that are not a bench of their own: a DP-SGD
step's peak memory, and two same-seed runs compared bit for bit. Each prints its figures
and writes them as JSON (``--json``); ``--device cpu`` runs them small on a CPU (the suite
does, so that a GPU's one lent hour is not lost to a typo).

    python bench/gpu_check_steps.py dp-memory --device cuda --batch 32 64 --json out.json
    python bench/gpu_check_steps.py same-seed --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import json
import resource
from pathlib import Path

import torch

from fedattn_shared.config import DPConfig, TrainConfig
from fedattn_shared.data.npz import Split
from fedattn_shared.methods import MethodContext, load_method
from fedattn_shared.privacy.dp import PrivateTraining
from fedattn_shared.schema import TRAIN, Payload, Section
from fl_edge.trainer import configure_determinism, train_local


def edge(model: str, device: torch.device, side: int, batch: int, dp: DPConfig | None = None):
    """A FedAvg edge as fl-edge builds it (seeded initial weights), having received them."""
    cls = load_method("fedavg")
    method = cls(MethodContext(TrainConfig(model=model, image_size=side, in_channels=3,
                                           batch_size=batch, lr=0.05, momentum=0.9),
                               cls.Params(), dp=dp))
    torch.manual_seed(0)
    algo = method.edge({k: m.to(device) for k, m in method.build_models().items()}, device)
    state = method.initial_state(algo.models)
    algo.receive(TRAIN, Payload([Section(k, n, t) for (k, n), t in state.items()]), Payload())
    return method, algo


def images(n: int, side: int, device: torch.device, seed: int = 0) -> Split:
    g = torch.Generator().manual_seed(seed)
    return Split(torch.randn(n, 3, side, side, generator=g).to(device),
                 torch.randint(0, 10, (n,), generator=g).to(device))


def dp_memory(args) -> list[dict]:
    """Peak memory of one round of DP-SGD steps (Poisson batches of the expected size):
    the GPU's allocator peak on CUDA, the process's peak RSS growth on a CPU."""
    rows = []
    for model in args.models:
        for batch in args.batch:
            dp = DPConfig(enabled=True, noise_multiplier=1.0, planned_rounds=1)
            method, algo = edge(model, args.device, args.side, batch, dp)
            privacy = PrivateTraining(algo, dp, batch * 2, batch)
            data = images(batch * 2, args.side, args.device)
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            if args.device.type == "cuda":
                torch.cuda.synchronize(args.device)
                torch.cuda.reset_peak_memory_stats(args.device)
                base = torch.cuda.memory_allocated(args.device)
            result = train_local(algo, data, 1, batch, seed=1, device=args.device,
                                 progress=False, privacy=privacy)
            if args.device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(args.device) - base
            else:
                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
            rows.append({"model": model, "batch": batch, "steps": result.steps,
                         "peak_bytes": peak, "device": str(args.device)})
            print(f"DP-SGD {model:<22} batch {batch:>3}: {result.steps} steps, peak "
                  f"{peak / 2**20:.0f} MiB above the model")
    return rows


def same_seed(args) -> list[dict]:
    """Two runs of the same seed from the same weights, compared tensor by tensor, with
    train.deterministic as the edge applies it (strict on CUDA unless --warn-only). An op
    without a deterministic kernel is a finding, reported, not a crash."""
    rows = []
    strict = args.device.type == "cuda" and not args.warn_only
    configure_determinism(True, args.threads, strict=strict)
    for model in args.models:
        states, error = [], None
        for _ in range(2):
            try:
                _, algo = edge(model, args.device, args.side, 16)
                train_local(algo, images(64, args.side, args.device), 2, 16, seed=3,
                            device=args.device, progress=False)
            except (RuntimeError, ValueError) as err:
                error = str(err).split("\n")[0][:300]
                break
            states.append({k: v.detach().cpu() for k, v in algo.models["model"].state_dict().items()})
        differing = [] if error else [k for k in states[0] if not torch.equal(states[0][k], states[1][k])]
        row = {"model": model, "device": str(args.device), "strict": strict, "error": error,
               "bit_identical": error is None and not differing, "differing": differing[:10],
               "tensors": len(states[0]) if states else 0}
        rows.append(row)
        verdict = (f"refused: {error}" if error else "bit-identical" if not differing
                   else f"{len(differing)} tensors differ (first: {differing[0]})")
        print(f"same seed twice {model:<22} strict={strict}: {verdict}")
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("step", choices=["dp-memory", "same-seed"])
    p.add_argument("--device", type=torch.device, default=torch.device("cpu"))
    p.add_argument("--models", nargs="+", default=["mobilenet-v3-small+gn", "resnet18-cifar+gn"])
    p.add_argument("--batch", nargs="+", type=int, default=[32, 64])
    p.add_argument("--side", type=int, default=32, help="image side")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warn-only", action="store_true",
                   help="same-seed: determinism that warns (--cuda-nondeterministic-ok)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = dp_memory(args) if args.step == "dp-memory" else same_seed(args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
