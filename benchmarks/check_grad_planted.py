"""The planted-bug example of docs/train-graph.md: Relu's (then MatMul's) input gradient scaled
by 1.02 through the rule registry, as ``tests/test_check_grad.py`` plants it, and what
``check_grad`` reports::

    python3 benchmarks/check_grad_planted.py | tee benchmarks/results/check_grad_planted.txt
"""

from __future__ import annotations

import dataclasses
import sys

import mpgraph
from mpgraph.autodiff import registry


def planted(op: str, model: str) -> None:
    key = ("", op)
    saved = list(registry._RULES[key])
    rule = registry.lookup_rule("", op, 18)

    def wrong(ctx, node, *dys):  # type: ignore[no-untyped-def]
        grads = list(rule.fn(ctx, node, *dys))
        grads[0] = ctx.op("Mul", grads[0], ctx.scalar(1.02, node.inputs[0]))
        return grads

    registry._RULES[key] = [dataclasses.replace(r, fn=wrong) if r is rule else r for r in saved]
    try:
        report = mpgraph.check_grad(model)
    finally:
        registry._RULES[key] = saved
    print(f">>> # {op} planted, {model}")
    print(">>> report.passed, [(p.name, round(p.rel_error, 4)) for p in report.failed]")
    print((report.passed, [(p.name, round(p.rel_error, 4)) for p in report.failed]))
    print(">>> report.first_bad_node")
    print(report.first_bad_node)
    print()


def main() -> int:
    print("$ python3 benchmarks/check_grad_planted.py")
    planted("Relu", "models/onnx/tiny_mlp.loss.onnx")
    planted("MatMul", "models/onnx/gpt.loss.onnx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
