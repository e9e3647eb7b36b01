"""``python -m diagnose.catalogs [--write PAGE]``: print the table of findings, or put it in PAGE.

PAGE (``docs/findings.md``) holds the table between two markers; ``--write`` replaces what lies
between them and leaves the rest of the page as it is.
"""

from __future__ import annotations

import sys
from pathlib import Path

from diagnose.catalogs import markdown_table

#: The markers the table sits between in its page; the catalog test reads the same two.
BEGIN = "<!-- findings table:"
END = "<!-- end of findings table -->"


def replace_table(page: str) -> str:
    """``page`` with the text between the markers replaced by the catalog's table."""
    start = page.index("\n", page.index(BEGIN)) + 1
    return page[:start] + markdown_table() + "\n" + page[page.index(END) :]


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--write":
        path = Path(argv[1])
        path.write_text(replace_table(path.read_text()))
        return 0
    if argv:
        print("usage: python -m diagnose.catalogs [--write PAGE]", file=sys.stderr)
        return 2
    print(markdown_table())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
