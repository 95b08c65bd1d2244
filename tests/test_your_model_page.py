"""docs/your-model-and-data.md's recipes are checked against the page itself: every command
in its bash blocks is read from the page and put through the real program. fl-server lines
resolve to a run (the model built by reference, the method accepting it, its split rules
selecting something, the codecs installed); fl-edge lines make the edge's options (an
--allow-model spec it takes); fl-demo lines resolve the fl-server flags the demo would pass;
fl-partition runs on a Parquet source written where the recipe reads it, and its edges load
under the recipe's server settings. The plug-in module the page shows is the file itself
(tests/test_docs.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from fedattn_shared.data import load_edge_data
from fl_edge.cli import build_parser as edge_parser
from fl_edge.cli import edge_options
from fl_server.cli import build_parser as server_parser
from fl_server.cli import resolve
from fl_tools.demo import build_parser as demo_parser
from fl_tools.demo import run_flags, server_settings

PAGE = Path(__file__).resolve().parent.parent / "docs" / "your-model-and-data.md"
PLUGINS = Path(__file__).resolve().parent / "plugins"
RECIPE = re.compile(r"^## (Recipe \d: .*?)$(.*?)(?=^## |\Z)", re.S | re.M)
BASH = re.compile(r"```bash\n(.*?)```", re.S)


def recipes() -> dict[str, list[list[str]]]:
    """Each recipe's commands (argv lists), in page order."""
    found = {}
    for title, body in RECIPE.findall(PAGE.read_text()):
        found[title] = [shlex.split(line) for block in BASH.findall(body)
                        for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    return found


def test_the_page_has_the_three_recipes():
    assert [title.split(":")[0] for title in recipes()] == ["Recipe 1", "Recipe 2", "Recipe 3"]
    assert all(recipes().values())


def check_server(argv: list[str]):
    _, train, method = resolve(server_parser().parse_args(argv))
    return train, method


def parquet_source(folder: Path, image: str, label: str) -> None:
    """A small Parquet source (28x28 grey, 10 classes) where a recipe's --source points."""
    import io

    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from PIL import Image

    rng = np.random.default_rng(0)
    images = []
    for _ in range(200):
        out = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8)).save(out, "PNG")
        images.append(out.getvalue())
    folder.mkdir(parents=True)
    pq.write_table(pa.table({image: images, label: [i % 10 for i in range(200)]}),
                   folder / "train.parquet")


@pytest.mark.parametrize("title", list(recipes()))
def test_every_command_of_the_recipe_runs_through_its_program(title, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))  # the recipe's own package is installed
    monkeypatch.chdir(tmp_path)
    train = None
    checked = []
    for argv in recipes()[title]:
        program, args = argv[0], argv[1:]
        if program == "fl-server":
            train, method = check_server(args)
            assert method.train.model == args[args.index("--model") + 1]
        elif program == "fl-demo":
            demo = demo_parser().parse_args(args)
            settings, _ = server_settings(demo)
            train, _ = check_server(["--insecure", *run_flags(demo, settings, demo.edges)])
        elif program == "fl-edge":
            data_dir = Path(flag(args, "--data-dir"))
            data_dir.mkdir(parents=True, exist_ok=True)  # the operator's data, beside the page's
            edge = edge_options(edge_parser().parse_args(args))
            assert set(edge.allow_models) == {a for i, a in enumerate(args)
                                               if i and args[i - 1] == "--allow-model"}
        elif program == "fl-partition":
            from fedattn_shared.data.partition import main as partition

            parquet_source(Path(flag(args, "--source")), flag(args, "--image-column"),
                           flag(args, "--label-column"))
            assert partition([*args, "--global-test-per-class", "2"]) == 0
        else:
            raise AssertionError(f"{title}: a command this test cannot check: {argv}")
        checked.append(program)
    if "fl-partition" in checked:  # the edges it wrote load under the recipe's settings
        out = Path(flag(next(a for a in recipes()[title] if a[0] == "fl-partition"), "--out"))
        data = load_edge_data(out / "edge_00", train)
        assert len(data.train) > 0 and (out / "edge_00" / "train.parquet").exists()


def flag(argv: list[str], name: str) -> str:
    """The value of ``name`` in a command line."""
    return argv[argv.index(name) + 1]


def test_the_refusal_the_page_quotes_is_the_one_pfedla_gives():
    """The page quotes pFedLA's refusal for timm:convnext_tiny: it is the method's own."""
    quoted = re.search(r"\n    (pfedla: no attention sites.*?)\n\n", PAGE.read_text(), re.S)[1]
    with pytest.raises(Exception) as err:
        check_server(["--method", "pfedla", "--model", "timm:convnext_tiny"])
    assert " ".join(quoted.split()) in str(err.value)
