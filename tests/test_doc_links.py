"""Every relative link in README.md and docs/**/*.md names an existing file,
and every docs/benchmarks/ path the docs and benchmarks/ mention exists."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).absolute().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SOURCES = DOCS + sorted((ROOT / "benchmarks").glob("*.py"))

_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_RECORD = re.compile(r"docs/benchmarks/[\w./*{},-]*[\w*}]")


def _relative_links(text):
    for target in _LINK.findall(_FENCE.sub("", text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        yield target.split("#", 1)[0]


@pytest.mark.skipif(not (ROOT / "docs").is_dir(), reason="docs/ not present")
@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    missing = [t for t in _relative_links(doc.read_text()) if not (doc.parent / t).exists()]
    assert not missing, f"{doc.relative_to(ROOT)}: broken links {missing}"


@pytest.mark.skipif(not (ROOT / "docs").is_dir(), reason="docs/ not present")
@pytest.mark.parametrize("src", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_record_paths_exist(src):
    """Paths under docs/benchmarks/ written out in prose or docstrings."""
    paths = {p for p in _RECORD.findall(src.read_text()) if not set("*{") & set(p)}
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"{src.relative_to(ROOT)}: missing {missing}"
