"""The CPU-checkable pieces of tools/commands/gpu_check.py, so the GPU script does not rot between GPU runs: its
random calls go through a backend's run() and match the PyTorch modules (here on ONNX Runtime CPU)."""

from __future__ import annotations

import numpy as np
import pytest

from eagle_export import contract as C
from eagle_export.export.checkpoint.loaders import load_eagle1_head, load_target
from eagle_export.export.graphs.heads import DraftStep
from eagle_export.export.graphs.target import TargetVerify
from eagle_export.manifest import load_manifest
from eagle_export.runtime import EagleRuntime
from eagle_export.tools.commands import gpu_check as G


@pytest.fixture(scope="module")
def setup(engines):
    target, draft, art = engines.sources("fp32")
    m = load_manifest(art)
    t = load_target(target, progress=False)
    head, _, _ = load_eagle1_head(draft, t)
    modules = {C.TARGET_GRAPH: TargetVerify(t.model).eval(), C.DRAFT_GRAPH: DraftStep(head, m.tree_limits.max_top_k)}
    return m, modules, EagleRuntime.open(art, threads=1, fused=False).backend


@pytest.mark.parametrize("graph, new, past, rows", [(C.TARGET_GRAPH, 20, 0, 1), (C.TARGET_GRAPH, 13, 30, 13),
                                                    (C.DRAFT_GRAPH, 20, 0, 0), (C.DRAFT_GRAPH, 4, 30, 4)])
def test_gpu_check_calls_match_pytorch(setup, graph, new, past, rows):
    m, modules, backend = setup
    x = G.graph_inputs(m, graph, new, past, rows, np.random.default_rng(0))
    errs = G.max_errors(G.run_backend(backend, m, graph, x), G.pytorch_outputs(modules, m, graph, x))
    assert max(errs.values()) < 1e-4, errs
    assert "present_*" in G.summarize(errs)


def test_gpu_check_runs_end_to_end_on_the_emulator(tmp_path):
    """The whole GPU script, TensorRT executed by the CPU emulator: export, build, greedy against transformers
    (1-token and chunked long prompts), sampling against the CPU reference, per-graph errors, timings, JSON."""
    import json

    from click.testing import CliRunner

    res = CliRunner().invoke(G.main, ["--emulate", "--workdir", str(tmp_path), "--case", "eagle1:fp32",
                                      "--prompts", "0", "--new-tokens", "8"])
    assert res.exit_code == 0, res.output
    assert "library: tensorrt_rtx 1.7.1.116; compute capability 8.9 (emulated on the CPU)" in res.output
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    case = summary["cases"]["eagle1:fp32"]
    assert summary["failures"] == [] and summary["emulated"]
    assert case["greedy_eagle"]["equal"] == case["greedy_eagle"]["total"] == 16
    assert [s["equal_prefix"] for s in case["sampled_vs_cpu"]] == [8, 8]
    assert case["speed"]["eagle"]["host_us_per_call"] > 0 and case["speed"]["eagle"]["device_us_per_call"] is None


def test_gpu_check_stops_first_on_a_library_the_gpu_cannot_run(tmp_path):
    """Through the CLI verb (`eagle-export gpu-check`, listed in --help): the mismatch stops it with the command that
    installs the library that runs there."""
    from click.testing import CliRunner

    from eagle_export.cli import main

    assert "gpu-check" in CliRunner().invoke(main, ["--help"]).output
    res = CliRunner().invoke(main, ["gpu-check", "--emulate", "--emulate-capability", "9.0", "--engine-lib",
                                    "tensorrt-rtx", "--workdir", str(tmp_path)])
    assert res.exit_code == 2
    assert "library: tensorrt_rtx 1.7.1.116; compute capability 9.0" in res.output
    assert "error: tensorrt_rtx cannot run on compute capability 9.0" in res.output
    assert "install the other library (pip install 'eagle-export[tensorrt]'" in res.output
    assert not (tmp_path / "target").exists()  # nothing was made before the check
