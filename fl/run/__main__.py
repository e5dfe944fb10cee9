"""`python -m fl.run`: the same as `fl-run`."""

from fl.run.cli import main

main()
