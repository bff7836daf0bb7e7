"""The runtime: ONNX Runtime sessions of the graphs mpgraph makes, the only part that imports
onnxruntime. It runs graphs and never edits the models it is given.

- ``providers``: providers, session and provider options, the CPU-fallback check, the forward
  part of a step graph for evaluation.
- ``trainer``: ``Trainer`` (state buffers, bindings, step, fit, CUDA-graph replay) and
  ``run_training`` (a run that checkpoints and survives signals).
- ``checkpoint``: checkpoint files, the graph fingerprint and the metrics history file.
- ``metrics``: ``StepResult`` and ``Metrics``.
- ``probe`` and ``check_runs``: the CPU runs that the compiler, the audit and
  ``check_grad`` make to look at numbers.
"""
