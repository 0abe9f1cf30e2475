"""The documentation holds together: every relative link in the README, docs/, bench/ and the
examples points at a file that exists."""
from __future__ import annotations

import re

from tests.helpers import ROOT

LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def broken_links(text: str, base) -> list[str]:
    return [t for t in LINK.findall(text) if not t.startswith(("http://", "https://", "mailto:"))
            and not (base / t).exists()]


def test_every_relative_link_resolves():
    pages = [ROOT / "README.md", ROOT / "bench" / "README.md", *ROOT.glob("docs/*.md"),
             *ROOT.glob("examples/*/README.md")]
    broken = {str(p.relative_to(ROOT)): b for p in pages if (b := broken_links(p.read_text(), p.parent))}
    assert len(pages) > 15 and not broken, broken


def test_the_link_check_sees_a_broken_link(tmp_path):
    (tmp_path / "there.md").write_text("x")
    text = "[ok](there.md) [ok too](there.md#part) [web](https://example.org/x) [gone](docs/there.md)"
    assert broken_links(text, tmp_path) == ["docs/there.md"]
