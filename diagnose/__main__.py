"""`python -m diagnose`."""

from diagnose.cli import main_exit

main_exit()
