"""Timing a runtime's graph calls: a proxy ``Backend`` that forwards every member and adds up the time in each graph.

bench, tune, round_bench and the tests put it between the EAGLE loop and its backend to split a round's time into
draft graph calls, target graph calls and host work (the rest). It lives beside the ``Backend`` protocol it
implements.
"""

from __future__ import annotations

import time
from collections import defaultdict

from eagle_export import contract as C
from eagle_export.tree_params import TreeParams

from .backend import Backend


class TimingBackend:
    """Wraps a backend (``runtime.backend.Backend``, which it implements too): forwards every member and times
    ``run`` per graph name.

    A backend that reports ``last_exec_s`` (ONNX Runtime: the time inside the session's run, binding excluded) is
    timed by that, so binding the call's buffers counts as host work. One that reports None (TensorRT: work queued
    on a stream) is synchronized after each call and timed around ``run`` + ``synchronize``, so the call's device
    work is inside its time.
    """

    def __init__(self, inner: Backend):
        self._inner = inner
        self.name = inner.name
        self.device = inner.device
        self.host_memory = inner.host_memory
        self.max_prefill = inner.max_prefill
        self.target_graph = inner.target_graph
        self.tree_graph = inner.tree_graph
        self.tree_depths = inner.tree_depths
        self.fixed_tree_depth = inner.fixed_tree_depth
        self.accepts_in_graph = inner.accepts_in_graph
        self.tree_selects = inner.tree_selects
        self.last_exec_s = inner.last_exec_s
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    @property
    def target_seconds(self) -> float:
        """Time in the target graph, whichever variant ran (standard or fused)."""
        return self.seconds.get(C.TARGET_GRAPH, 0.0) + self.seconds.get(C.TARGET_FUSED_GRAPH, 0.0)

    @property
    def draft_seconds(self) -> float:
        """Time in the draft graphs (the step graph, and the tree graphs where they ran)."""
        return sum(t for g, t in self.seconds.items() if g == C.DRAFT_GRAPH or C.is_tree_graph(g))

    def run(self, graph: str, inputs: dict, outputs: dict) -> None:
        inner = self._inner
        t0 = time.perf_counter()
        inner.run(graph, inputs, outputs)
        exec_s = inner.last_exec_s
        if exec_s is None:
            inner.synchronize()
            exec_s = time.perf_counter() - t0
        self.last_exec_s = exec_s
        self.seconds[graph] += exec_s
        self.calls[graph] += 1

    @property
    def open_s(self) -> float:
        """The wrapped backend's seconds spent opening sessions inside ``run`` (0 if it opens none there)."""
        return self._inner.open_s

    def zeros(self, shape: tuple[int, ...], dtype):
        return self._inner.zeros(shape, dtype)

    def check_tree(self, tree: TreeParams) -> None:
        self._inner.check_tree(tree)

    def to_host(self, x):
        return self._inner.to_host(x)

    def copy_from_host(self, dst, src) -> None:
        self._inner.copy_from_host(dst, src)

    def synchronize(self) -> None:
        self._inner.synchronize()

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


class TimingInstalled:
    """Puts a TimingBackend in place of the runtime's backend for the bench, and restores it after."""

    def __init__(self, rt):
        self.rt = rt
        self.inner = rt.generator.backend
        self.proxy = TimingBackend(self.inner)

    def __enter__(self) -> TimingBackend:
        self.rt.generator.backend = self.proxy
        self.rt.backend = self.proxy
        return self.proxy

    def __exit__(self, *exc):
        self.rt.generator.backend = self.inner
        self.rt.backend = self.inner
