"""The CPU-checkable pieces of tools/gpu_check.py, so the GPU script does not rot between GPU runs: its
random calls go through a backend's run() and match the PyTorch modules (here on ONNX Runtime CPU)."""

from __future__ import annotations

import numpy as np
import pytest

from eagle_export import contract as C
from eagle_export.export.loaders import load_eagle1_head, load_target
from eagle_export.export.modules import DraftStep, TargetVerify
from eagle_export.manifest import load_manifest
from eagle_export.runtime import EagleRuntime
from eagle_export.tools import gpu_check as G


@pytest.fixture(scope="module")
def setup(engines):
    target, draft, art = engines.sources("fp32")
    m = load_manifest(art)
    t = load_target(target, progress=False)
    head, _, _ = load_eagle1_head(draft, t)
    modules = {C.TARGET_GRAPH: TargetVerify(t.model).eval(), C.DRAFT_GRAPH: DraftStep(head, m.tree_limits.max_top_k)}
    return m, modules, EagleRuntime.open(art, threads=1).backend


@pytest.mark.parametrize("graph, new, past, rows", [(C.TARGET_GRAPH, 20, 0, 1), (C.TARGET_GRAPH, 13, 30, 13),
                                                    (C.DRAFT_GRAPH, 20, 0, 0), (C.DRAFT_GRAPH, 4, 30, 4)])
def test_gpu_check_calls_match_pytorch(setup, graph, new, past, rows):
    m, modules, backend = setup
    x = G.graph_inputs(m, graph, new, past, rows, np.random.default_rng(0))
    errs = G.max_errors(G.run_backend(backend, m, graph, x), G.pytorch_outputs(modules, m, graph, x))
    assert max(errs.values()) < 1e-4, errs
    assert "present_*" in G.summarize(errs)
