"""``python -m mpgraph`` runs the CLI."""

from mpgraph.cli import main

main()
