"""The floor every wing of mpgraph stands on.

- ``meta``: every metadata key, and ``Role``/``Precision``/``Category``/``Phase`` as StrEnums.
- ``builder``: the one ``Builder`` (nodes and constants with deterministic names and a role).
- ``names``: ``NameScope``, the one allocator of fresh value and node names.
- ``contract``: ``StepContract``, a step graph's contract (state, loss, gradients, logits,
  loss-scale state, data inputs, label bounds) as one typed record over the metadata.

Nothing here imports from the rest of mpgraph.
"""
