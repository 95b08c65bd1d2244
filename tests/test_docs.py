"""The docs are checked like code: a page that shows a file shows it as it is, generated pages
(CLI, config keys, method parameters) are what the code generates now, the site builds with
``mkdocs build --strict`` (no broken link, no page missing from the nav), and nothing in the
product points at a path outside the repository, which a user does not have."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"<!-- BEGIN (?P<path>\S+) .*?-->\n```\w*\n(?P<body>.*?)```\n<!-- END (?P=path) -->",
                   re.S)


def included_files() -> list[tuple[Path, str, str]]:
    found = []
    for page in sorted((REPO / "docs").rglob("*.md")):
        for match in BLOCK.finditer(page.read_text()):
            found.append((page, match["path"], match["body"]))
    return found


def test_the_docs_include_files():
    assert any(path == "tests/plugins/fedattn_example_plugin.py"
               for _, path, _ in included_files())


@pytest.mark.parametrize("page,path,body", included_files(),
                         ids=lambda v: v.name if isinstance(v, Path) else None)
def test_an_included_file_is_the_file_as_it_is(page, path, body):
    assert body == (REPO / path).read_text(), (
        f"{page.relative_to(REPO)} shows an old copy of {path}: paste the file again")


def test_the_pages_link_to_pages_that_exist():
    for page in sorted((REPO / "docs").rglob("*.md")):
        for target in re.findall(r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), (
                f"{page.relative_to(REPO)} links to missing {target}")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """What `make docs` runs, once for the module's checks of the built HTML. No skip when
    mkdocs is missing: the test extra installs it, and a site that CI cannot build is a
    broken product."""
    out = tmp_path_factory.mktemp("docs") / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                           "-f", str(REPO / "mkdocs.yml"), "-d", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    warnings = [line for line in output.splitlines() if "WARNING" in line or "ERROR" in line]
    assert done.returncode == 0 and not warnings, f"mkdocs build --strict failed:\n{output}"
    return out


def test_the_site_builds_strictly(site):
    assert (site / "methods" / "fedsap" / "index.html").exists()


class _TextBlocks(HTMLParser):
    """The running text of every paragraph and list item of a page, as the browser lays
    it out: a nested block (list, code, table) ends the text of the item around it."""

    TEXT = {"p", "li"}
    BLOCKS = {"ul", "ol", "pre", "table", "div", "blockquote"}

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[tuple[str, list[str] | None]] = []
        self.texts: list[tuple[str, str]] = []  # (tag, text)

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag in self.TEXT:
            self.stack.append((tag, []))
        elif tag in self.BLOCKS:
            self.stack.append((tag, None))

    def handle_endtag(self, tag: str) -> None:
        if tag in self.TEXT | self.BLOCKS:
            while self.stack:
                name, text = self.stack.pop()
                if text is not None:
                    self.texts.append((name, "".join(text)))
                if name == tag:
                    break

    def handle_data(self, data: str) -> None:
        if self.stack and self.stack[-1][1] is not None:
            self.stack[-1][1].append(data)


#: A line of running text that reads as a list item: Python-Markdown left a list as text
#: (it needs a blank line before a list, and an indented block inside an item, such as a
#: formula, ends the list unless the next item follows a blank line).
LIST_AS_TEXT = re.compile(r"[ \t]*(?:[-*+]|\d+\.)[ \t]+\S")


def test_no_list_renders_as_running_text(site):
    """The strict build passes a list that renders as one paragraph of "- " lines (the
    threat model of privacy-security.md read so): look at the built HTML."""
    found = []
    for page in sorted(site.rglob("*.html")):
        blocks = _TextBlocks()
        blocks.feed(page.read_text())
        for tag, text in blocks.texts:
            lines = text.strip().splitlines()
            # An item's own first line may read "1. One file" (a numbered heading in the
            # page's table of contents); a paragraph's may not.
            for line in lines[1:] if tag == "li" else lines:
                if LIST_AS_TEXT.match(line):
                    found.append(f"{page.parent.relative_to(site)}: {line.strip()[:80]!r}")
    assert not found, ("list items rendered as running text (a blank line before the list "
                       "or the item is missing):\n" + "\n".join(found))


def test_the_generated_pages_are_current():
    """Like tests/test_proto_current.py for the wire modules: a flag, config key or method
    parameter added without regenerating the docs fails here."""
    from fl_tools import docs

    stale = [str(path.relative_to(REPO)) for path, text in docs.expected_pages().items()
             if not path.exists() or path.read_text() != text]
    assert not stale, f"stale generated docs {stale}: run `{docs.REGENERATE}` (make reference)"


def test_the_cli_reference_never_shows_this_machine_s_token(monkeypatch):
    from fl_tools import docs

    monkeypatch.setenv("FEDATTN_TOKEN", "secret-join-token")
    page = docs.render_cli()
    assert "secret-join-token" not in page
    assert page == (REPO / "docs" / "reference" / "cli.md").read_text()


def test_every_registered_method_has_a_page_in_the_nav_and_the_table():
    from fedattn_shared.methods.registry import available_methods

    nav = (REPO / "mkdocs.yml").read_text()
    table = (REPO / "docs" / "methods" / "index.md").read_text()
    for name in available_methods():
        page = REPO / "docs" / "methods" / f"{name}.md"
        assert page.exists(), f"method {name!r} has no docs/methods/{name}.md"
        assert f"methods/{name}.md" in nav, f"docs/methods/{name}.md is not in mkdocs.yml's nav"
        assert f"]({name}.md)" in table, f"docs/methods/index.md's table has no row for {name}"
        assert f"--method {name}" in page.read_text()


def test_the_config_reference_shows_types_choices_and_comments():
    from fl_tools import docs

    page = docs.render_config()
    assert '| `optimizer` | "sgd" \\| "adam" | `"sgd"` |' in page
    assert "| `threads` | int | `0` | > 0: torch.set_num_threads on every edge" in page
    assert "| `upload_min_rate` | float | `32768.0` | bytes/s: an upload's total deadline is " \
           "idle timeout + its size / this rate |" in page
    assert '`"gap_log"`' in docs.render_params("pfedka")


PRODUCT = ["shared", "fl_server", "fl_edge", "tools", "docs", "deploy", "README.md"]
OUTSIDE = re.compile(r"\.\./shared|METHODS\.md|\bMETHODS \d|papers/")


@pytest.mark.parametrize("root", PRODUCT)
def test_the_product_names_no_path_outside_the_repository(root):
    """Users have the repository only: a docstring, comment or page that cites `../shared`,
    `METHODS.md` or `papers/...` points at nothing. Cite the paper's public link instead
    (arXiv/DOI) or the method's page under docs/methods/."""
    path = REPO / root
    files = [path] if path.is_file() else sorted(
        p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts
        and p.suffix not in {".png", ".npz", ".pyc", ".safetensors"})
    found = [f"{f.relative_to(REPO)}:{n}: {line.strip()}"
             for f in files for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1)
             if OUTSIDE.search(line)]
    assert not found, "paths outside the repository:\n" + "\n".join(found)
