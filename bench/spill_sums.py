"""What ``server.spill_sums`` costs a FedAvg round: the aggregator alone (no network),
ResNet-18 uploads taken and the round closed, with the float64 sum in RAM and with the
uploads spilled to disk and summed a slice at a time at the close. Each upload is a copy
of one seeded payload as the server holds it (views of one receive buffer); the weights
differ. Prints the seconds per accept (median) and of the close, and checks both give
the same bits.

    .venv/bin/python bench/spill_sums.py [--uploads 8 64] [--dir DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from fedattn_shared.config import TrainConfig
from fedattn_shared.methods import MethodContext, load_method
from fedattn_shared.methods.spill import UploadSpill
from fedattn_shared.schema import Kind, Payload, Section
from fedattn_shared.wire.serialize import encode
from fedattn_shared.wire.transport import PayloadAssembler, payload_chunks


def aggregator(spill_dir: Path | None):
    cls = load_method("fedavg")
    train = TrainConfig(model="resnet18-cifar", in_channels=3, image_size=32)
    method = cls(MethodContext(train, cls.Params()))
    agg = method.server(method.build_models())
    if spill_dir is not None:
        agg.spill = UploadSpill(spill_dir, 1 << 40)
    return agg


def one_upload(agg) -> Payload:
    shared = agg.state[(Kind.SHARED_TENSORS, "")]
    generator = torch.Generator().manual_seed(0)
    tensors = {k: v + torch.randn(v.shape, generator=generator) if v.is_floating_point()
               else v.clone() for k, v in shared.items()}
    encoded = encode(Payload([Section(Kind.SHARED_TENSORS, "", tensors)]))
    assembler = PayloadAssembler(encoded.manifest, 1 << 31, 1 << 20)
    for _, chunk in payload_chunks(encoded, 1 << 20):
        assembler.add(chunk)
    return assembler.finish()


def round_seconds(agg, upload: Payload, count: int) -> tuple[float, float]:
    edges = [f"e{i}" for i in range(count)]
    agg.begin_round(1, edges, count)
    accepts = []
    for i, edge in enumerate(edges):
        started = time.perf_counter()
        agg.accept(edge, upload, 1.0 + i)
        accepts.append(time.perf_counter() - started)
    started = time.perf_counter()
    agg.finish()
    return statistics.median(accepts), time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uploads", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--dir", type=Path, help="where the spill goes (default: a temp dir)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("FedAvg aggregator, resnet18-cifar uploads, 1 thread; seconds")
    for count in args.uploads:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            in_ram, on_disk = aggregator(None), aggregator(Path(tmp) / "uploads")
            upload = one_upload(in_ram)
            ram = round_seconds(in_ram, upload, count)
            disk = round_seconds(on_disk, upload, count)
            same = all(torch.equal(a, b) for a, b in zip(in_ram.state_tensors().values(),
                                                          on_disk.state_tensors().values(),
                                                          strict=True))
        print(f"  {count:3d} uploads: in RAM accept {ram[0]:.3f} close {ram[1]:.3f} "
              f"(round {ram[0] * count + ram[1]:.2f}); spilled accept {disk[0]:.3f} close "
              f"{disk[1]:.3f} (round {disk[0] * count + disk[1]:.2f}); same bits {same}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
