"""The user guide (docs/user-guide.md) by section, for the window's "What does this mean?" links.

A section's anchor is GitHub's slug of its heading (lower case, punctuation dropped, spaces to
hyphens), so a link names the same place in the app and on the rendered docs page.
`HELP_TOPICS` is every kind of result the window explains and the section that explains it;
a link to an anchor the guide does not have is an error, never an empty dialog.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from app.viewmodels.workspace import REPO_ROOT
from engine.errors import ForgebenchError

# A checkout (and the desktop bundle) has the guide under docs/; a wheel installs it as data.
GUIDE_PLACES = (REPO_ROOT / "docs" / "user-guide.md",
                Path(sys.prefix) / "share" / "forgebench" / "user-guide.md")
HELP_TOPICS = {"findings": "dataset-findings", "verdicts": "export-verdicts",
               "metrics": "run-metrics"}
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: `Leaks & duplicates` → `leaks--duplicates`."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def guide_path() -> Path:
    for place in GUIDE_PLACES:
        if place.is_file():
            return place
    raise ForgebenchError("the user guide is not installed with this copy of Forgebench",
                          path=GUIDE_PLACES[0], hint="read docs/user-guide.md in the source")


def sections(text: str) -> dict[str, str]:
    """anchor → the section's markdown: its heading line down to the next heading of the same
    or a higher level (its subsections included). Fenced code is not read for headings."""
    lines = text.splitlines()
    headings, fenced = [], False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        match = None if fenced else _HEADING.match(line)
        if match:
            headings.append((i, len(match.group(1)), slug(match.group(2))))
    found = {}
    for k, (start, level, anchor) in enumerate(headings):
        end = next((i for i, lv, _ in headings[k + 1:] if lv <= level), len(lines))
        found.setdefault(anchor, "\n".join(lines[start:end]).strip())
    return found


def guide_section(anchor: str, path: Path | None = None) -> str:
    path = path or guide_path()
    found = sections(path.read_text(encoding="utf-8"))
    if anchor not in found:
        raise ForgebenchError(f"the user guide has no section #{anchor}", path=path,
                              hint="sections: " + ", ".join(sorted(found)))
    return found[anchor]
