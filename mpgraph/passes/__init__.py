"""The compiler's passes, one per module, and ``Pipeline``, the pass manager that runs them.

Example:
    >>> class Fails(ir.passes.InPlacePass):
    ...     def call(self, model):
    ...         raise ValueError("no such tensor")
    >>> model = ir.Model(ir.Graph([], [], nodes=[]), ir_version=8)
    >>> try:
    ...     Pipeline([Fails()])(model)
    ... except ValueError as e:
    ...     print(e.__notes__)
    ['raised in pass 1 of 1 of the pipeline: Fails']
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import onnx_ir as ir

__all__ = ["Pipeline"]

logger = logging.getLogger(__name__)


class Pipeline(ir.passes.PassManager):
    """onnx_ir's ``PassManager`` (one step), whose failures keep their type and name the pass.

    onnx_ir's manager wraps whatever a pass raises in ``PassError`` s. mpgraph's own errors must
    reach the CLI as they are (one line, exit 2), so here the exception a pass raises comes out
    unchanged, with a note naming the pass and its place (``__notes__``, printed under the
    traceback).
    """

    def __init__(self, passes: Sequence[ir.passes.PassBase]) -> None:
        super().__init__(passes, steps=1)

    @property
    def names(self) -> list[str]:
        """The passes' class names, in order."""
        return [type(p).__name__ for p in self.passes]

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for index, (name, pass_) in enumerate(zip(self.names, self.passes), start=1):
            logger.debug("pass %d of %d: %s", index, len(self.passes), name)
            try:
                result = pass_(model)
            except Exception as e:
                e.add_note(f"raised in pass {index} of {len(self.passes)} of the pipeline: {name}")
                raise
            model, modified = result.model, modified or result.modified
        return ir.passes.PassResult(model, modified)
