"""The front door and the reference pages hold together: every relative link in README.md, CONTRIBUTING.md,
recipes/README.md and docs/ resolves (to a file, and to a heading when it names one), every repository path
they cite in backquotes exists, and the README stays a front door."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        ROOT / "recipes" / "README.md",
        *ROOT.glob("docs/*.md"),
    ]
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
#: A backquoted path into the repository's own folders (``kfac_bench/kfac/capture.py``, ``launch/``).
CITED = re.compile(
    r"`((?:kfac_bench|tests|benchmarks|configs|recipes|launch|docs)/[\w./-]*?)(?::\w+)?`"
)

#: Paths of other public repositories that the pages cite by name (NVIDIA's and the authors' Mask R-CNN
#: configs), not of this one.
ELSEWHERE = {
    "configs/e2e_mask_rcnn_R_50_FPN_1x_bs64.yaml",
    "configs/e2e_mask_rcnn_R_50_FPN_1x_64GPU.yaml",
}


def _placeholder(path: str) -> bool:
    """``recipes/NAME.yaml``, ``runs/<run>``: a pattern a reader fills in, not a path."""
    return (
        "*" in path or "<" in path or re.search(r"(?<![a-z])[A-Z]{2,}(?![a-z])", path) is not None
    )


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    lines = page.read_text().splitlines()
    return {_anchor(line.lstrip("#")) for line in lines if line.startswith("#")}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: outside the repository
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        heading_missing = destination.suffix == ".md" and anchor not in _anchors(destination)
        if not destination.exists() or (anchor and heading_missing):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_repository_path_exists(page: Path) -> None:
    text = page.read_text()
    cited = {p for p in CITED.findall(text) if not _placeholder(p) and p not in ELSEWHERE}
    missing = sorted(p for p in cited if not (ROOT / p).exists())
    assert not missing, f"{page.relative_to(ROOT)} cites paths that do not exist: {missing}"


def test_the_readme_is_a_front_door() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    for command in ("make train", "make test"):
        assert command in text


def test_anchor_of_a_heading_with_code_and_punctuation() -> None:
    assert _anchor(" Which layers K-FAC preconditions") == "which-layers-k-fac-preconditions"
    assert (
        _anchor(" Cheaper factor statistics, 2026-12-03") == "cheaper-factor-statistics-2026-12-03"
    )
