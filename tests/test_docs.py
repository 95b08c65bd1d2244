"""The docs' copies of code are the code: a page that shows a file must show it as it is."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"<!-- BEGIN (?P<path>\S+) .*?-->\n```\w*\n(?P<body>.*?)```\n<!-- END (?P=path) -->",
                   re.S)


def included_files() -> list[tuple[Path, str, str]]:
    found = []
    for page in sorted((REPO / "docs").glob("*.md")):
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
    for page in sorted((REPO / "docs").glob("*.md")):
        for target in re.findall(r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"
