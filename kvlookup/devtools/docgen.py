"""``python -m kvlookup.devtools.docgen``: write the settings table of docs/configuration.md
from the declarations (kvlookup.config.options.markdown_table); tests/config/test_settings.py checks it."""

from __future__ import annotations

import sys
from pathlib import Path

from kvlookup.config import Settings
from kvlookup.config.options import markdown_table

HEADER = "| setting | flag | environment | default | read by | meaning |"


def rewrite(doc: str) -> str:
    """``doc`` with its settings table (from HEADER to the first line not starting with ``|``) replaced."""
    lines = doc.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith(HEADER))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "".join(lines[:start]) + markdown_table(Settings) + "".join(lines[end:])


def main() -> int:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/configuration.md")
    path.write_text(rewrite(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
