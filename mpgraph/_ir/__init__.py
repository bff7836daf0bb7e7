"""The floor every wing of mpgraph stands on: metadata keys and enums (``meta``).

Nothing here imports from the rest of mpgraph.
"""
