"""The one interface between the EAGLE loop and a graph runtime.

The generator (``generator.py``) allocates every buffer once, through ``Backend.zeros``, and then calls
``Backend.run`` with ``BufferView``s (``views.py``) of those buffers: address, dtype, shape and where the memory
lives. ``OrtBackend`` (ONNX Runtime), ``TrtBackend`` (TensorRT engines) and ``timing.TimingBackend`` (the timing proxy
bench puts around either) implement it; ``tests/test_trt_backend.py::test_backends_implement_the_protocol`` checks
that each does. Every member is required: the loop never asks
whether a backend has one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from eagle_export.tree_params import TreeParams

from .views import BufferView


@runtime_checkable
class Backend(Protocol):
    """What the EAGLE loop needs from a graph runtime (one target graph and one draft graph)."""

    #: Short name: "ort" or "tensorrt" (what ``--backend`` takes).
    name: str
    #: The target graph it runs (``contract.graph_for``): "target_verify_fused" (ONNX Runtime, where the artifact has
    #: it; the loop then binds whole-buffer caches written in place) or "target_verify".
    target_graph: str
    #: The draft tree graph it runs (``contract.DRAFT_TREE_GRAPH``: a round's draft work in one call), or None: the
    #: loop then drafts with the step graph alone.
    tree_graph: str | None
    #: Where it has one: top_k -> the most levels a tree call of that top_k grows (``contract.tree_call``); empty: none.
    tree_depths: dict[int, int]
    #: True when a tree call always grows those levels (a TensorRT engine is one cut; a shallower tree of its top_k
    #: reads the first levels' candidates); False: a call is cut to the round's depth (ONNX Runtime).
    fixed_tree_depth: bool
    #: True when every target call also returns the greedy acceptance of its logit rows (``contract.with_acceptance``:
    #: a TensorRT verify engine built with ``engines/round_ops.py``'s operators); the loop binds those outputs.
    accepts_in_graph: bool
    #: top_k -> how many candidates its tree calls also return as a verify tree (``contract.with_selection``).
    tree_selects: dict[int, int]
    #: The torch device of the buffers ``zeros`` allocates ("cpu", "cuda:0").
    device: str
    #: True when those buffers are plain host memory that the loop may read and write through numpy views at any
    #: time (ONNX Runtime on the CPU). False: the loop reads them only through ``to_host``.
    host_memory: bool
    #: The largest prompt chunk one prefill call may take (TensorRT: the prefill profile's maximum), or None.
    max_prefill: int | None
    #: Seconds the last ``run`` spent executing the graph, binding excluded (bench's draft/target/host split), or
    #: None when the backend cannot tell (work queued on a device stream: time ``run`` + ``synchronize`` instead).
    last_exec_s: float | None
    #: Seconds spent so far opening sessions inside ``run`` (a graph opened when first run), which the loop leaves
    #: out of a round's time; 0.0 for a backend that opens everything up front.
    open_s: float

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled contiguous buffer on ``device``, aligned as the backend binds memory (256 bytes)."""
        ...

    def check_tree(self, tree: TreeParams) -> None:
        """Raise ``GenerationError`` when a round of this tree cannot run (engines built for smaller trees)."""
        ...

    def run(self, graph: str, inputs: Mapping[str, BufferView], outputs: Mapping[str, BufferView]) -> None:
        """Run ``graph`` ("target_verify" or "draft_step") on exactly the graph's inputs and outputs.

        Views of host memory (``device`` "cpu") are read when the call is made: the caller may refill them
        once ``run`` returns. Outputs are written in place; on a device they are ready for work the caller
        queues afterwards on its current stream, and for ``to_host``. ``outputs`` may be a read-only
        ``types.MappingProxyType``: passed again as the same object, a backend may take its bindings as they
        were (the generator makes one per call shape; nothing can change it).
        """
        ...

    def to_host(self, x: torch.Tensor) -> np.ndarray:
        """A host copy of (rows of) a buffer from ``zeros``, once the work queued before it has written them."""
        ...

    def copy_from_host(self, dst: torch.Tensor, src: np.ndarray) -> None:
        """``dst`` (a contiguous buffer from ``zeros``) = ``src`` (a host array of its bytes), ordered before work the
        caller queues next; on a device without blocking the host (no stream synchronisation)."""
        ...

    def synchronize(self) -> None:
        """Wait until all work this backend queued has finished (a no-op where ``run`` is synchronous)."""
        ...
