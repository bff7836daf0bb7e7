"""``RunOptions``: every choice about how a step graph runs, in one frozen record.

The ``Trainer``'s keywords, the ``mpgraph train`` flags and the ``Executor`` read the same
record; nothing forwards loose ``**options``. What each field does is documented on
``Trainer`` (``mpgraph.runtime.trainer``), which maps its keywords onto this record.

Example:
    >>> options = RunOptions(provider="cpu", threads=1)
    >>> options.replace(kernels=False).kernels, options.kernels
    (False, None)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RunOptions"]


@dataclass(frozen=True)
class RunOptions:
    """How one step graph runs (see ``Trainer`` for each field's meaning and default)."""

    provider: str = "cpu"
    device_id: int = 0
    threads: int | None = None
    allow_cpu_fallback: bool = False
    track_scale: bool = True
    provider_options: Mapping[str, str] = field(default_factory=dict)
    tf32: bool | None = None
    cuda_graph: bool | None = None
    kernels: bool | None = None
    mem_pattern: bool | None = None
    pipeline: bool | None = None
    deterministic: bool = False
    inplace_state: bool | None = None

    def replace(self, **changes: Any) -> RunOptions:
        """A copy with ``changes`` (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """The option names, as the ``Trainer`` accepts them as keywords."""
        return tuple(f.name for f in dataclasses.fields(cls))
