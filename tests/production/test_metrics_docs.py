"""Issue 34: the README's Metrics section describes every family the endpoint serves, and names no
family the code does not serve."""

from __future__ import annotations

import re
from pathlib import Path

from cacheseek.prometheus import FAMILIES

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_describes_every_served_metric():
    text = README.read_text()
    section = text[text.index("## Metrics"):]
    section = section[: section.index("\n## ", 1)]
    table = "\n".join(line for line in section.splitlines() if line.startswith("| `cacheseek_"))
    named = set(re.findall(r"`(cacheseek_[a-z0-9_]+)`", table))
    assert named == set(FAMILIES), (sorted(set(FAMILIES) - named), sorted(named - set(FAMILIES)))
