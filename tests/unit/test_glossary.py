"""The pages that index the library stay true to its source.

- docs/glossary.md: every file a word is "defined in" exists, and a `file: name` there names
  something the file holds; the library's own words (WORDS) each have a row.
- docs/adaptive.md: every constant of the run-time choices (`auto`'s online trials in
  auto/online.py, shm's store choice in csrc/runtime/shm.h) is named on the page, so a new
  or renamed constant shows up here until the page explains it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GLOSSARY = ROOT / "docs" / "glossary.md"
ADAPTIVE = ROOT / "docs" / "adaptive.md"
#: Words a newcomer meets in the code and docs with a meaning of the library's own.
WORDS = ("agreement", "rides", "claim", "fast entry", "Prepared", "native", "trial", "turn",
         "runoff", "settled", "review", "stores", "window", "meet", "joined", "contributors",
         "snapshot", "epoch", "buddies", "held", "stall", "process set", "flight recorder",
         "job clock", "last to arrive", "straggler", "data phase", "frozen", "rig")
#: A source path in a glossary cell, optionally followed by `: name`.
PLACE = re.compile(r"((?:collectives|csrc|optim|benchmarks|docs|tests)/[\w/.]+\.(?:py|h|cpp|md)"
                   r"|benchmarks/README\.md)(?::\s*`?(\w+)`?)?")


def rows() -> list[tuple[str, str]]:
    """(words, defined in) of every row of the glossary's table."""
    out = []
    for line in GLOSSARY.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("Word", "---"):
            out.append((cells[0], cells[2]))
    return out


def test_every_place_the_glossary_names_exists_and_holds_the_name():
    found = rows()
    assert len(found) >= 20, found
    for words, where in found:
        places = PLACE.findall(where)
        assert places, f"{words!r}: no source path in {where!r}"
        for path, name in places:
            assert (ROOT / path).is_file(), f"{words!r}: {path} does not exist"
            if name:
                assert re.search(rf"\b{name}\b", (ROOT / path).read_text()), \
                    f"{words!r}: {path} holds no {name!r}"


def test_the_librarys_own_words_each_have_a_row():
    listed = " , ".join(words for words, _ in rows())
    missing = [w for w in WORDS if not re.search(rf"(?<![\w-]){re.escape(w)}(?![\w-])", listed)]
    assert not missing, f"docs/glossary.md has no row for {missing}"


def test_every_constant_of_the_run_time_choices_is_on_the_adaptive_page():
    page = ADAPTIVE.read_text()
    online = (ROOT / "collectives" / "auto" / "online.py").read_text()
    stores = (ROOT / "csrc" / "runtime" / "shm.h").read_text()
    constants = re.findall(r"^([A-Z][A-Z_]+) = ", online, flags=re.M)
    constants += re.findall(r"static constexpr \w+ (k\w+) = ", stores)
    assert len(constants) >= 15, constants
    missing = [c for c in constants if f"`{c}`" not in page]
    assert not missing, f"docs/adaptive.md does not name {missing}"
