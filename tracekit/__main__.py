"""`python -m tracekit ...`: the `tracekit` command where no console script was installed (a
checkout on PYTHONPATH, as on the GPU machine)."""

from tracekit.cli import main

main(prog_name="tracekit")
