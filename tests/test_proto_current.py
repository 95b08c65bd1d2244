"""The checked-in wire modules must be exactly what proto/ generates (run `make proto`)."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_generated_modules_are_current(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_proto", REPO / "scripts" / "gen_proto.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    gen.generate(tmp_path)
    for name in gen.OUT_NAMES:
        fresh = (tmp_path / name).read_text()
        current = (REPO / "shared" / "wire" / name).read_text()
        assert fresh == current, f"shared/wire/{name} is stale: run `make proto`"
