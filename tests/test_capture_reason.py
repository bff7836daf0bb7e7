"""Why CUDA graphs went off keeps the end of ORT's message, where the kernel says what it refused.

ORT's failed run under capture starts with a generic first line (the CUDA call's C++ signature,
as ORT 1.31.1 wrote it on the H200) and ends with the cause; the reason used to keep only the
first line. The executor is faked around ``_launch_replay`` (CUDA is not needed to fail a run).
"""

from __future__ import annotations

import types

import pytest

from mpgraph.errors import MpgraphError
from mpgraph.runtime.executor import Executor

_GENERIC = ("Error in execution: /onnxruntime_src/onnxruntime/core/providers/cuda/cuda_call.cc:154 "
            "std::conditional_t<THRW, void, onnxruntime::common::Status> onnxruntime::CudaCall(ERRTYPE, const char*, "
            "const char*, SUCCTYPE, const char*, const char*, int) [with ERRTYPE = cudaError; bool THRW = true; "
            "SUCCTYPE = cudaError; std::conditional_t<THRW, void, onnxruntime::common::Status> = void]")
_CAUSE = "CUDA Concat supports at most 32 inputs during CUDA Graph capture"


class _FailingSession:
    def run_with_iobinding(self, binding, options) -> None:
        raise RuntimeError(f"{_GENERIC}\n\n  node 'optim/amax/concat'\n{_CAUSE}\n")


def _executor(require_graph: bool) -> Executor:
    executor = Executor.__new__(Executor)  # only what _launch_replay reads before it fails
    executor._require_graph, executor._want_graph, executor.cuda_graph = require_graph, True, True
    executor.inplace, executor.pipeline, executor.sets = frozenset(), False, [{}]
    executor.replay = types.SimpleNamespace(
        session=_FailingSession(), bindings=[None], options=[(None, None)], runs=0,
        upload=lambda batch, slot: None, nosync=lambda pipelined: False)
    return executor


def test_capture_failure_keeps_the_cause() -> None:
    executor = _executor(require_graph=False)
    assert executor._launch_replay(executor.replay, {}, 0) is None
    reason = executor.cuda_graph_reason
    assert not executor.cuda_graph and executor.replay is None
    assert reason.startswith("capture failed: Error in execution:") and reason.endswith(_CAUSE)
    assert "\n" not in reason and len(reason) <= len("capture failed: ") + 300


def test_required_graph_names_the_cause() -> None:
    executor = _executor(require_graph=True)
    with pytest.raises(MpgraphError, match=_CAUSE):
        executor._launch_replay(executor.replay, {}, 0)
