"""The docs are current: the generated benchmark page and every link into a doc's headings."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "benchmarks.md"

#: a markdown link's target: ``[text](target)``, not an image's and not a URL
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~)")


def _docs() -> list[pathlib.Path]:
    return sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
                   *(ROOT / "docs" / "benchmarks.d").glob("*.md")])


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text().splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        if fenced or not line.startswith("#"):
            continue
        slug = _slug(line.lstrip("#"))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_benchmark_page_is_what_the_generator_writes(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "benchmarks.md"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "report.py"), "--root", str(ROOT),
                          "--out", str(out), "--no-plots"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert out.read_bytes() == PAGE.read_bytes(), (
        "docs/benchmarks.md is stale or was edited by hand: run .venv/bin/python bench/report.py "
        "(hand-written sections go in docs/benchmarks.d/)")


def test_every_plot_the_page_shows_is_committed() -> None:
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", PAGE.read_text())
    assert images, "the benchmark page shows no plot"
    for rel in images:
        assert (PAGE.parent / rel).is_file(), f"{rel} is missing: run bench/report.py"


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_links_between_docs_resolve(doc: pathlib.Path) -> None:
    bad = []
    fenced = False
    for line in doc.read_text().splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        if fenced:
            continue
        for target in _LINK.findall(line):
            if re.match(r"[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (doc.parent / file_part).resolve() if file_part else doc
            if not dest.exists():
                bad.append(f"{target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{target}: no such heading")
    assert not bad, f"{doc.relative_to(ROOT)}: " + "; ".join(bad)
