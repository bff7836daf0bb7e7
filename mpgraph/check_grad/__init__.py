"""Check a model's training gradients against central finite differences, without torch.

``check_grad`` answers "does the step graph mpgraph builds for *my* model compute the right
gradients?" on the user's own model, with ONNX Runtime alone:

1. **Gradient graph.** ``build_training_graph(model, optimizer=None, loss=...)``: outputs the
   loss and ``grad/<param>`` for every parameter. Dropout runs in inference mode for the check
   (a random mask has no finite difference; the training-mode rule has its own table case).
2. **Inputs.** Generated with a fixed seed: floats standard normal; integer inputs valid for
   what consumes them (token ids below the rows of the ``Gather`` table they index, labels below
   the class count of the loss op that reads them, ``*mask*`` inputs all ones). An ``.npz``
   (``inputs=``) replaces them; its keys must be exactly the model's data inputs.
3. **Precision.** The forward (for finite differences) and the gradient graph run in float64
   where ORT's CPU provider has float64 kernels. An op without one runs in float32 between
   Casts, except a 2-D ``Conv`` or ``ConvTranspose`` (and ``GlobalAveragePool``/``GlobalMaxPool``),
   which is rewritten into float64 ops: a float32 Conv's rounding would swamp every CNN's
   finite differences, and a float32 op anywhere forces a 1000x larger step, which crosses
   Relu kinks. The report says which ops stayed float32; the step and the tolerance follow
   (``STEP``, ``RTOL``).
4. **Per parameter.** A direction ``d`` of unit norm, half random and half along the analytic
   gradient (so ``|<g, d>|`` is of the order of ``|g|`` even for a million-element tensor and the
   finite difference resolves it), then ``<g, d>`` against
   ``(L(p + h d) - L(p - h d)) / 2h``, with ``h`` chosen to move the loss by a fixed fraction.
   A disagreement is retried at 1/4 and 1/16 of the step: kinks (Relu, MaxPool) and curvature
   shrink with the step and rounding grows, so an error that changes 2x over those steps, or
   is within 4x their spread, is the finite difference's own (``noisy``); one that stays put
   is a wrong gradient (``fail``).
5. **Localization.** When a parameter fails, every node on the backward path is checked alone,
   closest to the loss first: its gradient rule is applied to the node's real forward values and
   a random output cotangent, and each input cotangent is compared with finite differences of
   ``<cotangent, node(x)>``. The failing node closest to the loss is where the backward pass
   first goes wrong (``GradCheckReport.first_bad_node``). Ops with ties or kinks (MaxPool,
   Relu, Max, ...) are checked at slightly jittered inputs, where a derivative exists.

The modules, in the order a check runs: ``graphs`` (the gradient graph, the forward cut),
``inputs``, ``precision`` and ``float64`` (3), ``fd`` and ``check`` (4), ``localize`` (5),
``report``. Sessions come from ``mpgraph.runtime.check_runs``.

Example:
    >>> from pathlib import Path
    >>> zoo = Path(__file__).resolve().parents[2] / "models" / "onnx"
    >>> report = check_grad(zoo / "tiny_mlp.loss.onnx")
    >>> report.passed, report.dtype, [p.name for p in report.params][:2]
    (True, 'float64', ['fc1.weight', 'fc1.bias'])
"""

from mpgraph.check_grad.check import check_grad
from mpgraph.check_grad.report import GradCheckReport, InputsError, NodeCheck, ParamCheck

__all__ = ["check_grad", "GradCheckReport", "ParamCheck", "NodeCheck", "InputsError"]
