"""`python -m pitstop.cli`: the same as the `pitstop` command."""

from pitstop.cli import main

main()
