"""Regenerate the wire modules in shared/wire/ from proto/fedattn/v1/fedattn.proto.

protoc writes absolute imports (``from fedattn.v1 import fedattn_pb2``); they are
rewritten to relative ones so the generated code lives inside ``fedattn_shared.wire``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO = PROTO_ROOT / "fedattn" / "v1" / "fedattn.proto"
OUT_NAMES = ("fedattn_pb2.py", "fedattn_pb2.pyi", "fedattn_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(PROTO),
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        for name in OUT_NAMES:
            text = (Path(tmp) / "fedattn" / "v1" / name).read_text()
            text = text.replace("from fedattn.v1 import fedattn_pb2", "from . import fedattn_pb2")
            (out_dir / name).write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "shared" / "wire")
    args = parser.parse_args(argv)
    generate(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
