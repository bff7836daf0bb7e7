"""The runtime: ONNX Runtime sessions of the graphs mpgraph makes, the only part that imports
onnxruntime. It runs session plans and never rewrites a graph itself.

- ``providers``: providers, session and provider options, the CPU-fallback check, the forward
  part of a step graph for evaluation.
- ``trainer``: ``Trainer``, the public face of the three parts below, driven by one frozen
  ``options.RunOptions``:
  ``program`` (``Program``: the step contract and its session plans, which it asks of
  ``mpgraph.lowering.plan_session``, the only name the runtime imports from the lowering),
  ``executor`` (``Executor``: one device's sessions, state buffer ring and IOBindings,
  ``replay`` of CUDA graphs, pipelining) and the loop (``loop.TrainingLoop`` over
  ``stream.DataStream``: steps, fit, the data stream, checkpoints, metrics);
  ``run``: ``run_training`` (a run that checkpoints and survives signals).
- ``checkpoint``: checkpoint files, the graph fingerprint and the metrics history file.
- ``metrics``: ``StepResult`` and ``Metrics``.
- ``probe`` and ``check_runs``: the CPU runs that the compiler, the audit and
  ``check_grad`` make to look at numbers.
"""
