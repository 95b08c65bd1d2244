"""What the server's exact sum costs, before and after a change, on the same machine in
one sitting: ``add_scaled`` (one upload added into the in-memory compensated pair, as
a streaming mean's accept with ``server.spill_sums`` off) and ``spilled_mean`` (the
close of a spilled round: N uploads read back from disk and summed a slice at a time).
Each side runs in its own process with its checkout's code, interleaved ``--repeats``
times; seeded float32 uploads of ResNet-18's size with weights 1..N. Prints the wall
and CPU seconds (medians), the after/before ratios, and whether both give the same bits
(a SHA-256 of the mean).

    .venv/bin/python bench/exact_sum.py --before CHECKOUT [--uploads 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESNET18_PARAMS = 11_173_962


def measure(count: int, size: int, directory: Path) -> dict:
    """One side's figures (runs in the checkout's own process)."""
    import torch

    from fedattn_shared.methods.exact_sum import add_scaled, spilled_mean
    from fedattn_shared.methods.spill import UploadSpill
    from fedattn_shared.schema import Kind

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    key = (Kind.SHARED_TENSORS, "")
    spill = UploadSpill(directory, 1 << 40)
    spilled, values = [], None
    for i in range(count):
        values = torch.randn(size, generator=generator) * 10 ** torch.randint(
            -3, 2, (size,), generator=generator)
        path = spill.write_raw(1, f"e{i}", f"e{i}", [memoryview(values.numpy()).cast("B")])
        spilled.append((path, float(i + 1), {key: (0, [torch.float32])}))
    total, comp = torch.zeros(size, dtype=torch.float64), torch.zeros(size, dtype=torch.float64)
    add_scaled(total, values, 3.0, comp)  # page the pair in, outside the timing
    wall, cpu = time.perf_counter(), time.process_time()
    add_scaled(total, values, 3.0, comp)
    add = (time.perf_counter() - wall, time.process_time() - cpu)
    weight = sum(w for _, w, _ in spilled)
    wall, cpu = time.perf_counter(), time.process_time()
    mean = spilled_mean(spilled, key, [("w", torch.float32, (size,))], weight)["w"]
    close = (time.perf_counter() - wall, time.process_time() - cpu)
    spill.clear()
    return {"add": add, "close": close,
            "sha256": hashlib.sha256(mean.numpy().tobytes()).hexdigest()[:16]}


def side(checkout: Path | None, count: int, size: int) -> dict:
    """``measure`` in a fresh process, with ``checkout``'s code (None: this checkout's)."""
    from wire import checkout_path

    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ)
        if checkout is not None:
            env["PYTHONPATH"] = checkout_path(checkout, Path(tmp))
        out = subprocess.run(
            [sys.executable, __file__, "--measure", str(count), str(size), str(Path(tmp) / "u")],
            env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, metavar="CHECKOUT")
    parser.add_argument("--uploads", type=int, default=8)
    parser.add_argument("--size", type=int, default=RESNET18_PARAMS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--measure", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(int(args.measure[0]), int(args.measure[1]),
                                 Path(args.measure[2]))))
        return 0
    if args.before is None:
        parser.error("--before CHECKOUT is required")
    print(f"exact sum, {args.uploads} float32 uploads of {args.size / 1e6:.2f} M values, "
          f"{os.cpu_count()} cores; before = {args.before}, after = this checkout")
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for repeat in range(args.repeats):
        load = os.getloadavg()[0]
        for label, checkout in (("before", args.before), ("after", None)):
            runs[label].append(side(checkout, args.uploads, args.size))
        b, a = runs["before"][-1], runs["after"][-1]
        print(f"  repeat {repeat}: add_scaled CPU {b['add'][1]:.3f} -> {a['add'][1]:.3f} s; "
              f"close wall {b['close'][0]:.3f} -> {a['close'][0]:.3f} s, CPU "
              f"{b['close'][1]:.3f} -> {a['close'][1]:.3f} s; load avg {load:.2f} before",
              flush=True)
    for name, title in (("add", "add_scaled, one upload"), ("close", "spilled close")):
        for index, what in ((0, "wall"), (1, "CPU")):
            b = statistics.median(r[name][index] for r in runs["before"])
            a = statistics.median(r[name][index] for r in runs["after"])
            print(f"  {title:<24} {what:4s} before {b:.3f} s, after {a:.3f} s = {a / b:.2f}x")
    hashes = {r["sha256"] for r in runs["before"] + runs["after"]}
    print(f"  same bits before and after: {len(hashes) == 1}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
