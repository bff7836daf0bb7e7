"""The floor every wing of mpgraph stands on.

- ``meta``: every metadata key, and ``Role``/``Precision``/``Category``/``Phase`` as StrEnums.
- ``builder``: the one ``Builder`` (nodes and constants with deterministic names and a role).
- ``names``: ``NameScope``, the one allocator of fresh value and node names.

Nothing here imports from the rest of mpgraph.
"""
