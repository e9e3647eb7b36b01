"""``python -m diagnose.catalogs``: print the README's table of findings."""

from diagnose.catalogs import markdown_table

print(markdown_table())
