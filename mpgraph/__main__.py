"""``python -m mpgraph`` runs the CLI."""

from mpgraph.cli.main import main

main()
