"""Codec throughput, and whether a codec pays for itself on a 100 Mbit/s link.

For each codec, on one float32 vector of --values values (default 11.25M: 45 MB, a
ResNet-18-sized update), with torch on 1 and on 2 threads: encode and decode speed in MB of
float32 input per second (best of --reps), the encoded / raw byte ratio, and the
break-even on a --mbit link: the codec pays when the transfer time it saves,
(raw - encoded bytes) / link bytes per second, exceeds the time it spends, encode + decode.
Figures are printed, never asserted (they depend on the machine and its load).

    .venv/bin/python bench/codecs.py [--values 11250000] [--reps 3] [--mbit 100]
                                     [--codecs fp16 bf16 int8 int4 topk:0.01]
"""

from __future__ import annotations

import argparse
import time

import torch

from fedattn_shared.compress import load_codec

DEFAULT_CODECS = ["fp16", "bf16", "int8", "int4", "int8:64", "topk:0.01", "topk:0.1"]


def best_seconds(fn, reps: int) -> float:
    """The fastest of ``reps`` calls (the least disturbed by the machine's other work)."""
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--values", type=int, default=11_250_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--mbit", type=float, default=100.0, help="link speed, Mbit/s")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--codecs", nargs="+", default=DEFAULT_CODECS)
    args = parser.parse_args()

    n = args.values
    raw = 4 * n
    link = args.mbit * 1e6 / 8  # bytes per second
    # an update-like vector: small changes, a few large ones
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 1e-3
    print(f"vector: {n} float32 values = {raw / 1e6:.1f} MB; link {args.mbit:g} Mbit/s "
          f"= {link / 1e6:.2f} MB/s; raw transfer {raw / link:.2f} s; best of {args.reps}")
    print(f"{'codec':<11} {'thr':>3} {'ratio':>7} {'enc MB/s':>9} {'dec MB/s':>9} "
          f"{'enc+dec s':>9} {'saved s':>8}  verdict")
    for spec in args.codecs:
        codec = load_codec(spec).codec
        encoded = codec.encoded_bytes(n)
        saved = (raw - encoded) / link
        for threads in args.threads:
            torch.set_num_threads(threads)
            generator = torch.Generator().manual_seed(1)
            parts = codec.encode(x, generator)
            assert sum(p.numel() * p.element_size() for p in parts.values()) == encoded
            enc = best_seconds(lambda: codec.encode(x, generator), args.reps)  # noqa: B023
            dec = best_seconds(lambda: codec.decode(parts, n), args.reps)  # noqa: B023
            verdict = "pays" if saved > enc + dec else "does not pay"
            print(f"{codec.spec:<11} {threads:>3} {encoded / raw:>7.4f} {raw / enc / 1e6:>9.0f} "
                  f"{raw / dec / 1e6:>9.0f} {enc + dec:>9.3f} {saved:>8.2f}  {verdict}")


if __name__ == "__main__":
    main()
