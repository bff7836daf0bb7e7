"""Conv weight-gradient forms A/B, per layer shape, on ORT (CPU or CUDA), interleaved in one process.

For each layer shape it builds, with the Conv gradient rule itself, one small graph per variant
and times them in alternating chunks (so background load hits all alike):

- ``dW im2col``: the one-hot im2col forms (SpaceToDepth where it applies), the rule's older form;
- ``dW conv``: the weight gradient as one Conv (batch and channels swapped, stride <-> dilation);
- ``dW auto``: what the rule emits by default (``WEIGHT_GRAD_FORM = None``), to check the
  encoded choice;
- ``dX``: the data gradient (ConvTranspose, or Conv with the flipped kernel at unit stride), and
  ``fwd``: the forward Conv, to show each one's share of the layer's time.

Inputs and outputs stay on the device (IO binding), so a CUDA run times the kernels and launches,
not host copies. With torch installed it also times torch's own weight and data gradient
(``aten.convolution_backward``) on the same threads/device, for the ratio the issue quotes.

Shapes: the Nature DQN's three convs at batch 32, the zoo ResNet's convs at batch 32, and two
depthwise convs. Prints median ms per call, the spread (min-max over rounds) and the ratios.

Run: ``.venv/bin/python benchmarks/conv_dw_ab.py [--provider cpu|cuda] [--threads 1,2] [--rounds 9]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mpgraph.autodiff.rules.pool_conv as pool_conv  # noqa: E402
from mpgraph.autodiff.driver import GradContext  # noqa: E402


@dataclass(frozen=True)
class Layer:
    """A 2-D Conv layer: input ``[n, c, h, w]``, ``m`` outputs, square kernel, symmetric pads."""

    name: str
    n: int
    c: int
    h: int
    m: int
    k: int
    stride: int = 1
    pad: int = 0
    group: int = 1

    @property
    def out(self) -> int:
        return (self.h + 2 * self.pad - self.k) // self.stride + 1


LAYERS = [
    Layer("dqn.conv1 8x8/4", 32, 4, 84, 32, 8, 4),
    Layer("dqn.conv2 4x4/2", 32, 32, 20, 64, 4, 2),
    Layer("dqn.conv3 3x3/1", 32, 64, 9, 64, 3, 1),
    Layer("res.stem 3x3", 32, 3, 32, 16, 3, 1, 1),
    Layer("res.l1.conv 3x3 (x2)", 32, 16, 32, 16, 3, 1, 1),
    Layer("res.l2.conv1 3x3/2", 32, 16, 32, 32, 3, 2, 1),
    Layer("res.l2.conv2 3x3", 32, 32, 16, 32, 3, 1, 1),
    Layer("res.l2.short 1x1/2", 32, 16, 32, 32, 1, 2),
    Layer("res.l3.conv1 3x3/2", 32, 32, 16, 64, 3, 2, 1),
    Layer("res.l3.conv2 3x3", 32, 64, 8, 64, 3, 1, 1),
    Layer("res.l3.short 1x1/2", 32, 32, 16, 64, 1, 2),
    # Probes of the kernel-size boundary (not in the zoo): 5x5/1, a 7x7/2 stem, 4x4/1.
    Layer("probe 5x5 c16 28x28", 32, 16, 28, 32, 5, 1, 2),
    Layer("probe 7x7/2 stem 64x64", 32, 3, 64, 32, 7, 2, 3),
    Layer("probe 4x4/1 c32 16x16", 32, 32, 16, 32, 4, 1),
    Layer("probe 5x5 c16 28x28 nopad", 32, 16, 28, 32, 5, 1, 0),
    Layer("probe 4x4/1 c32 16x16 pad1", 32, 32, 16, 32, 4, 1, 1),
    Layer("probe 5x5/2 c32 32x32 pad2", 32, 32, 32, 64, 5, 2, 2),
    Layer("dw 3x3 c64 32x32", 32, 64, 32, 64, 3, 1, 1, 64),
    Layer("dw 3x3/2 c128 16x16", 32, 128, 16, 128, 3, 2, 1, 128),
]

#: Variants: (label, which gradient, WEIGHT_GRAD_FORM while building); "dX convT" builds the
#: unit-stride data gradient as ConvTranspose instead of a Conv with the flipped kernel.
VARIANTS = [("dW im2col", "dw", "im2col"), ("dW conv", "dw", "conv"), ("dW slices", "dw", "slices"), ("dW auto", "dw", None),
            ("dX", "dx", None), ("dX convT", "dx", "convT"), ("fwd", "fwd", None)]


def build_graph(layer: Layer, which: str, form: str | None) -> bytes:
    """A graph from ``x``, ``w``, ``dy`` to the chosen gradient (or the forward output), built by
    the Conv rule with ``WEIGHT_GRAD_FORM = form``."""
    f32 = ir.DataType.FLOAT
    x = ir.Value(name="x", shape=ir.Shape([layer.n, layer.c, layer.h, layer.h]), type=ir.TensorType(f32))
    w = ir.Value(name="w", shape=ir.Shape([layer.m, layer.c // layer.group, layer.k, layer.k]), type=ir.TensorType(f32))
    dy = ir.Value(name="dy", shape=ir.Shape([layer.n, layer.m, layer.out, layer.out]), type=ir.TensorType(f32))
    attrs = ir.convenience.convert_attributes(
        {"strides": [layer.stride] * 2, "pads": [layer.pad] * 4, "group": layer.group, "kernel_shape": [layer.k] * 2})
    node = ir.Node("", "Conv", [x, w], attrs, num_outputs=1, name="conv")
    node.outputs[0].name, node.outputs[0].shape, node.outputs[0].type = "y", dy.shape, ir.TensorType(f32)
    graph = ir.Graph([x, w, dy], [], nodes=[], name="g", opset_imports={"": 18})
    if which == "fwd":
        graph.append(node)
        graph.outputs.append(node.outputs[0])
    else:
        ctx = GradContext(graph)
        ctx.node, ctx.needed = node, [which == "dx", which == "dw", False]
        saved = pool_conv.WEIGHT_GRAD_FORM, pool_conv.UNIT_STRIDE_AS_CONV
        pool_conv.WEIGHT_GRAD_FORM = form if form != "convT" else None
        pool_conv.UNIT_STRIDE_AS_CONV = saved[1] and form != "convT"
        try:
            dx, dw, _ = pool_conv.conv(ctx, node, dy)
        finally:
            pool_conv.WEIGHT_GRAD_FORM, pool_conv.UNIT_STRIDE_AS_CONV = saved
        result = dx if which == "dx" else dw
        assert result is not None
        result.name = "grad"
        graph.outputs.append(result)
    return ir.to_proto(ir.Model(graph, ir_version=8)).SerializeToString()


def ops_of(blob: bytes) -> str:
    """Op types of a built graph, e.g. 'Transpose,Conv,Transpose'."""
    import onnx

    return ",".join(n.op_type for n in onnx.load_from_string(blob).graph.node if n.op_type not in ("Shape", "Concat"))


class OrtCall:
    """One session with its inputs (and outputs) bound on the device."""

    def __init__(self, blob: bytes, feeds: dict[str, np.ndarray], provider: str, threads: int) -> None:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.intra_op_num_threads = threads
        providers = ["CUDAExecutionProvider"] if provider == "cuda" else ["CPUExecutionProvider"]
        self.session = ort.InferenceSession(blob, options, providers=providers)
        device = "cuda" if provider == "cuda" else "cpu"
        self.binding = self.session.io_binding()
        names = {i.name for i in self.session.get_inputs()}
        self.values = [ort.OrtValue.ortvalue_from_numpy(a, device, 0) for n, a in feeds.items() if n in names]
        for (name, _), value in zip([(n, a) for n, a in feeds.items() if n in names], self.values, strict=True):
            self.binding.bind_ortvalue_input(name, value)
        for out in self.session.get_outputs():
            self.binding.bind_output(out.name, device, 0)

    def __call__(self) -> None:
        self.session.run_with_iobinding(self.binding)

    def result(self) -> np.ndarray:
        self()
        return self.binding.copy_outputs_to_cpu()[0]


def torch_calls(layer: Layer, feeds: dict[str, np.ndarray], provider: str) -> dict[str, object]:
    """torch's weight and data gradient of the layer (``aten.convolution_backward``), or {}."""
    try:
        import torch
    except ImportError:
        return {}
    device = "cuda" if provider == "cuda" else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        return {}
    x, w, dy = (torch.from_numpy(feeds[k]).to(device) for k in ("x", "w", "dy"))

    def call(mask: list[bool]):
        def run() -> None:
            torch.ops.aten.convolution_backward(dy, x, w, None, [layer.stride] * 2, [layer.pad] * 2, [1, 1],
                                                False, [0, 0], layer.group, mask)
            if device == "cuda":
                torch.cuda.synchronize()
        return run

    def dw() -> np.ndarray:
        return torch.ops.aten.convolution_backward(dy, x, w, None, [layer.stride] * 2, [layer.pad] * 2, [1, 1], False,
                                                   [0, 0], layer.group, [False, True, False])[1].cpu().numpy()

    return {"torch dW": call([False, True, False]), "torch dX": call([True, False, False]), "_dw": dw}


def interleaved(calls: dict[str, object], rounds: int, steps: int, gap: float, clock=time.perf_counter) -> dict[str, list[float]]:
    """ms per call of each, timed in alternating chunks of ``steps`` calls, each chunk after
    ``gap`` seconds of rest and one untimed call (no chunk runs into another's spinning threads)."""
    samples: dict[str, list[float]] = {k: [] for k in calls}
    for fn in calls.values():
        fn()
    for _ in range(rounds):
        for key, fn in calls.items():
            time.sleep(gap)
            fn()
            t0 = clock()
            for _ in range(steps):
                fn()
            samples[key].append(1e3 * (clock() - t0) / steps)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", default="1,2", help="intra-op threads (CPU), comma separated")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=5, help="calls per timed chunk")
    parser.add_argument("--gap", type=float, default=None,
                        help="seconds of rest before each chunk (default 0.3 on CPU: with 0.02 the 2-thread "
                             "ranking of the DQN's forms flipped between runs, other sessions' threads still spinning)")
    parser.add_argument("--layers", default="", help="substring filter on layer names")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: this process's CPU time, which at 1 thread (all work on the calling thread) "
                             "leaves out the time other processes hold the core; at 2 threads it counts spinning")
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")] if args.provider == "cpu" else [0]
    if args.gap is None:
        args.gap = 0.3 if args.provider == "cpu" else 0.0
    layers = [la for la in LAYERS if args.layers in la.name]
    rng = np.random.default_rng(0)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"ORT {ort.__version__} {args.provider}; {args.rounds} rounds of {args.steps} calls, interleaved; "
          f"median ms per call [min-max], {args.clock} clock")
    for layer in layers:
        feeds = {"x": rng.standard_normal((layer.n, layer.c, layer.h, layer.h)).astype(np.float32),
                 "w": rng.standard_normal((layer.m, layer.c // layer.group, layer.k, layer.k)).astype(np.float32),
                 "dy": rng.standard_normal((layer.n, layer.m, layer.out, layer.out)).astype(np.float32)}
        blobs = {label: build_graph(layer, which, form) for label, which, form in VARIANTS}
        auto_form = next(k for k in ("dW im2col", "dW conv", "dW slices") if blobs[k] == blobs["dW auto"])[3:]
        if blobs["dX convT"] == blobs["dX"]:  # strided: both are ConvTranspose already
            del blobs["dX convT"]
        print(f"\n{layer.name}: x {layer.n}x{layer.c}x{layer.h}x{layer.h} -> {layer.m}x{layer.out}x{layer.out}, "
              f"group {layer.group}; auto picks '{auto_form}'")
        for form in ("im2col", "conv", "slices"):
            print(f"  {form} ops: {ops_of(blobs['dW ' + form])}")
        for t in threads:
            calls: dict[str, object] = {label: OrtCall(blob, feeds, args.provider, t) for label, blob in blobs.items()}
            if args.provider == "cpu":
                import torch

                torch.set_num_threads(t)
            extra = torch_calls(layer, feeds, args.provider)
            reference = extra.pop("_dw", None)
            a, b = calls["dW im2col"].result(), calls["dW conv"].result()  # type: ignore[attr-defined]
            error = float(np.abs(a - b).max() / np.abs(a).max())
            if reference is not None:
                error = max(error, float(np.abs(reference() - b).max() / np.abs(a).max()))  # type: ignore[operator]
            assert error < 1e-4, (layer.name, error)
            calls.update(extra)
            samples = interleaved(calls, args.rounds, args.steps, args.gap, clock)
            med = {k: statistics.median(v) for k, v in samples.items()}
            cells = "  ".join(f"{k} {med[k]:.3f} [{min(v):.3f}-{max(v):.3f}]" for k, v in samples.items())
            best = {k: min(v) for k, v in samples.items()}  # the least-disturbed chunk, on a loaded machine
            ratios = "  ".join(f"{f}/im2col {med['dW ' + f] / med['dW im2col']:.2f} (of minima {best['dW ' + f] / best['dW im2col']:.2f})"
                               for f in ("conv", "slices"))
            if "dX convT" in med:
                ratios += f"  dX convT/dX {med['dX convT'] / med['dX']:.2f}"
            if "torch dW" in med:
                ratios += (f"  im2col/torch {med['dW im2col'] / med['torch dW']:.2f}"
                           f"  conv/torch {med['dW conv'] / med['torch dW']:.2f}"
                           f"  dX/torch dX {med['dX'] / med['torch dX']:.2f}")
            share = med["dX"] / (med["fwd"] + med["dX"] + med["dW auto"])
            label = f"threads={t}" if args.provider == "cpu" else args.provider
            print(f"  {label}: {cells}\n    {ratios}  dX share of fwd+dX+dW auto {share:.0%}  (max rel diff {error:.1e})")


if __name__ == "__main__":
    main()
