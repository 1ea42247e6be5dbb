"""OrtGraph keeps IO bindings between runs and rebinds a name only when its address, type or shape changed."""

from __future__ import annotations

from types import MappingProxyType

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from eagle_export.runtime.ort_backend import OrtGraph, session_options
from eagle_export.runtime.views import SplitInputs


@pytest.fixture()
def graph(tmp_path):
    """z = x + y over float32 [n]."""
    x, y, z = (helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n"]) for n in "xyz")
    model = helper.make_model(helper.make_graph([helper.make_node("Add", ["x", "y"], ["z"])], "add", [x, y], [z]),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = tmp_path / "add.onnx"
    onnx.save(model, str(path))
    return OrtGraph(path, ["CPUExecutionProvider"], threads=1)


def count_binds(graph, monkeypatch) -> list[str]:
    calls = []
    real = graph._bind

    def counted(name, *args):
        calls.append(name)
        return real(name, *args)
    monkeypatch.setattr(graph, "_bind", counted)
    return calls


def test_unchanged_bindings_are_kept_and_see_new_values(graph, monkeypatch):
    calls = count_binds(graph, monkeypatch)
    x = np.arange(4, dtype=np.float32)
    y = torch.ones(4)
    z = torch.zeros(8)
    graph.run({"x": x, "y": y}, {"z": z[:4]})
    assert sorted(calls) == ["x", "y", "z"]
    assert z[:4].tolist() == [1, 2, 3, 4]

    # Same addresses and shapes, new values in place: nothing is rebound and the run reads the new values.
    calls.clear()
    x[:] = 10
    y.fill_(2)
    graph.run({"x": x, "y": y}, {"z": z[:4]})
    assert calls == []
    assert z[:4].tolist() == [12, 12, 12, 12]

    # A new address (output rows further on) or a new shape rebinds just that name.
    calls.clear()
    graph.run({"x": x, "y": y}, {"z": z[4:]})
    assert calls == ["z"]
    assert z[4:].tolist() == [12, 12, 12, 12]
    calls.clear()
    graph.run({"x": x[:2], "y": y[:2]}, {"z": z[:2]})
    assert sorted(calls) == ["x", "y", "z"]
    assert z.tolist() == [12, 12, 12, 12, 12, 12, 12, 12]
    x2 = np.full(2, -1, dtype=np.float32)  # another array: another address
    calls.clear()
    graph.run({"x": x2, "y": y[:2]}, {"z": z[:2]})
    assert calls == ["x"]
    assert z[:2].tolist() == [1, 1]


def test_missing_or_extra_names_are_refused(graph):
    x = np.zeros(2, dtype=np.float32)
    with pytest.raises(ValueError, match="exactly the graph's inputs"):
        graph.run({"x": x}, {"z": np.zeros(2, dtype=np.float32)})
    with pytest.raises(ValueError, match="exactly the graph's inputs"):
        graph.run({"x": x, "y": x, "w": x}, {"z": np.zeros(2, dtype=np.float32)})


def test_non_contiguous_is_refused(graph):
    x = torch.zeros(4)[::2]
    with pytest.raises(ValueError, match="contiguous"):
        graph.run({"x": x, "y": x}, {"z": torch.zeros(2)})


def test_a_read_only_outputs_mapping_seen_last_run_is_not_rechecked(graph, monkeypatch):
    calls = count_binds(graph, monkeypatch)
    x, y = np.arange(4, dtype=np.float32), np.ones(4, dtype=np.float32)
    z = torch.zeros(8)
    outs = MappingProxyType({"z": z[:4]})
    graph.run({"x": x, "y": y}, outs)
    assert sorted(calls) == ["x", "y", "z"] and graph._same_outputs is outs
    calls.clear()
    x[:] = 5
    graph.run({"x": x, "y": y}, outs)  # the same read-only mapping: its binding stands, the run writes z[:4]
    assert calls == [] and z[:4].tolist() == [6, 6, 6, 6]
    other = MappingProxyType({"z": z[4:]})  # another mapping is checked and bound as usual
    graph.run({"x": x, "y": y}, other)
    assert calls == ["z"] and z[4:].tolist() == [6, 6, 6, 6]
    calls.clear()
    graph.run({"x": x, "y": y}, {"z": z[4:]})  # a plain dict is always checked (it could have been changed)
    assert calls == [] and graph._same_outputs is None
    with pytest.raises(ValueError, match="exactly the graph's inputs"):
        graph.run({"x": x, "w": y}, outs)  # right count, a name the graph lacks


def test_fp16_on_the_cpu_says_what_it_costs(models, caplog):
    """Opening fp16 graphs on the CPU provider warns that their weights become float32 (twice the memory) and says
    to export fp32 for the CPU; fp32 graphs open without it."""
    from eagle_export.manifest import load_manifest
    from eagle_export.runtime.ort_backend import OrtBackend

    for dtype, warned in (("fp16", True), ("fp32", False)):
        _, _, art = models("mha", dtype=dtype)
        caplog.clear()
        with caplog.at_level("WARNING", logger="eagle_export.runtime.ort_backend"):
            OrtBackend(art, load_manifest(art), threads=1)
        text = " ".join(r.getMessage() for r in caplog.records)
        assert ("--dtype fp32 for the CPU" in text and "twice" in text) is warned, text


@pytest.mark.parametrize("spin, allow, stop", [("off", "0", None), ("run", "1", "1"), ("on", "1", None)])
def test_spin_policy_sets_onnx_runtime_spinning(spin, allow, stop):
    """Each policy is the ONNX Runtime configuration docs/runtime.md names: "run" spins during a call and stops as
    it returns (the loop's host work keeps its core), "off" never spins, "on" spins after the call too."""
    opts = session_options(2, spin)

    def entry(key):
        try:
            return opts.get_session_config_entry(key)
        except Exception:  # noqa: BLE001 - ONNX Runtime raises for a key never set
            return None

    assert entry("session.intra_op.allow_spinning") == allow
    assert entry("session.force_spinning_stop") == stop
    assert opts.intra_op_num_threads == 2


def test_unknown_spin_policy_is_refused():
    with pytest.raises(ValueError, match="spin must be one of"):
        session_options(None, "sometimes")


def test_spin_per_phase_applies_to_each_phases_sessions(models):
    """"target=run,draft=off": the target graph's session spins during its calls, the draft graphs' sessions never
    (each session has its own thread pool); a bare policy applies to all; a typo names the forms it takes."""
    from eagle_export import contract as C
    from eagle_export.manifest import load_manifest
    from eagle_export.runtime.ort_backend import DEFAULT_PHASES, DEFAULT_SPIN, OrtBackend, parse_spin

    assert parse_spin("run") == {"target": "run", "draft": "run"}
    assert parse_spin("draft=on") == {"target": DEFAULT_PHASES["target"], "draft": "on"}
    assert parse_spin(DEFAULT_SPIN) == DEFAULT_PHASES == {"target": "run", "draft": "off"}
    for bad in ("target=fast", "verify=run", "target=run;draft=off"):
        with pytest.raises(ValueError, match="per phase like 'target=run,draft=off'"):
            parse_spin(bad)
    _, _, art = models("mha")
    m = load_manifest(art)
    be = OrtBackend(art, m, threads=1, spin="target=run,draft=off")

    def allow(name):
        return be.graph(name).session.get_session_options().get_session_config_entry(
            "session.intra_op.allow_spinning")

    assert allow(be.target_graph) == "1"
    assert allow(C.DRAFT_GRAPH) == "0" and allow(C.tree_call(m.tree_defaults.top_k, m.tree_defaults.depth)) == "0"


def test_split_inputs_fixed_part_seen_last_run_is_not_rechecked(graph, monkeypatch):
    """SplitInputs' read-only fixed part, the same object as last run, is not looked at again (the fused target's
    2 x layers cache views); another fixed part is checked and bound; and after a run that failed while binding, the
    next run checks everything (the failed run may have rebound a fixed name)."""
    calls = count_binds(graph, monkeypatch)
    seen: list[str] = []

    class Spy(dict):
        def get(self, k, d=None):
            seen.append(k)
            return super().get(k, d)

    x, x2 = np.full(4, 1, dtype=np.float32), np.full(4, 100, dtype=np.float32)
    y = np.zeros(4, dtype=np.float32)
    z = torch.zeros(4)
    outs = MappingProxyType({"z": z})
    f1, f2 = MappingProxyType({"x": x}), MappingProxyType({"x": x2})
    graph.run(SplitInputs(f1, {"y": y}), outs)
    assert sorted(calls) == ["x", "y", "z"] and z.tolist() == [1] * 4
    graph._bound_in = Spy(graph._bound_in)
    calls.clear()
    y[:] = 2
    graph.run(SplitInputs(f1, {"y": y}), outs)
    assert seen == ["y"] and calls == [] and z.tolist() == [3] * 4
    seen.clear()
    graph.run(SplitInputs(f2, {"y": y}), outs)  # another fixed part: checked, x rebound
    assert seen == ["x", "y"] and calls == ["x"] and z.tolist() == [102] * 4
    graph.run(SplitInputs(f1, {"y": y}), outs)
    assert z.tolist() == [3] * 4
    with pytest.raises(ValueError, match="contiguous"):  # binds x to x2, then fails on y
        graph.run(SplitInputs(f2, {"y": torch.zeros(8)[::2]}), outs)
    seen.clear()
    graph.run(SplitInputs(f1, {"y": y}), outs)  # x is checked again and bound back to x
    assert "x" in seen and z.tolist() == [3] * 4
