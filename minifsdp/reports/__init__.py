"""The tour and every chapter's report: each trains or builds with the package, measures, and prints a
table (and a figure) that the docs include. `python -m minifsdp --help` lists the commands."""
