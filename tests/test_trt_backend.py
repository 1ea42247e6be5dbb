"""The TensorRT backend's per-call planning (profile choice, shape checks, the (name, shape, address) bindings,
staging and unaligned-output scratch): by hand on fake device addresses, and over whole generations of the real
generator on aligned host memory standing for device memory; the Backend protocol; clear errors without engines
or CUDA. Execution is tested on the CPU emulator (test_trt_emulated.py); on a real GPU only where torch sees a
CUDA device (skipped here with the reason)."""

from __future__ import annotations

import itertools
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from eagle_export import contract as C
from eagle_export.cli import main
from eagle_export.dtypes import DTYPES
from eagle_export.errors import EagleExportError, EngineError, GenerationError
from eagle_export.manifest import load_manifest
from eagle_export.runtime import EagleRuntime
from eagle_export.runtime.backend import Backend
from eagle_export.runtime.embedding import TokenEmbedding
from eagle_export.runtime.generator import Generator
from eagle_export.runtime.ort_backend import OrtBackend
from eagle_export.runtime.trt_backend import (
    Buffer,
    GraphBindings,
    TrtBackend,
    buffer_layout,
    profiles_of,
)
from eagle_export.runtime.views import BufferView, tensor_address, view_of
from eagle_export.tree_params import TreeParams

NO_CUDA = "no CUDA device: TensorRT engines are built here (TensorRT-RTX, ahead of time) but cannot run"
BASE = 1 << 40  # fake device addresses: 256-byte aligned like CUDA allocations
HOST = 0x7000_0000  # a fake host address (the planner never reads host memory)


def desc(shape: tuple, dtype: str, address: int | None) -> BufferView:
    """A view of fake device memory at ``address``, or (None) of a host array."""
    return BufferView(HOST if address is None else address, dtype, shape, "cpu" if address is None else "cuda", 0)


def planners(manifest, alignment=256):
    """GraphBindings per graph with fake staging/scratch addresses, laid out as TrtBackend lays them out."""
    fake = itertools.count(BASE, 1 << 24)
    out = {}
    for name in C.ENGINE_GRAPHS:
        g = manifest.graphs[name]
        profiles = profiles_of(manifest, name)
        staging, scratch = buffer_layout(g.spec, profiles, alignment)
        out[name] = GraphBindings(
            name, g.spec, profiles,
            staging={n: Buffer(next(fake), k * DTYPES[dt].itemsize) for n, (dt, k) in staging.items()},
            scratch={n: Buffer(next(fake), k * DTYPES[dt].itemsize) for n, (dt, k) in scratch.items()},
            alignment=alignment,
        )
    return out


@pytest.fixture(scope="module")
def m32(engines):
    return load_manifest(engines("fp32"))


@pytest.fixture(scope="module")
def m16(engines):
    return load_manifest(engines("fp16"))


def target_call(past: int, new: int, rows: int, dtype="float32", cache=0x10_0000_0000, row_bytes=256):
    """Descs for a target call: host ids/positions/mask/rows, device cache views and outputs."""
    kv = lambda rows_, addr: desc((1, rows_, 4, 16), dtype, addr)  # noqa: E731
    inputs = {C.INPUT_IDS: desc((1, new), "int64", None), C.POSITION_IDS: desc((1, new), "int64", None),
              C.ATTENTION_MASK: desc((1, new, past + new), "bool", None),
              C.LOGIT_INDICES: desc((1, rows), "int64", None)}
    outputs = {C.LOGITS: desc((1, rows, 48), "float32", 0x20_0000_0000),
               C.FEATURES: desc((1, new, 64), dtype, 0x30_0000_0000)}
    for i, name in enumerate(C.past_names(2)):
        inputs[name] = kv(past, cache + i * 0x1_0000_0000)
    for i, name in enumerate(C.present_names(2)):
        outputs[name] = kv(new, cache + i * 0x1_0000_0000 + past * row_bytes)
    return inputs, outputs


def test_buffer_layout(m32, m16):
    spec = m32.graphs[C.TARGET_GRAPH].spec
    staging, scratch = buffer_layout(spec, profiles_of(m32, C.TARGET_GRAPH))
    # The prefill profile's mask is the largest: 64 rows x (63 + 64) keys.
    assert staging == {C.INPUT_IDS: ("int64", 64), C.POSITION_IDS: ("int64", 64),
                       C.ATTENTION_MASK: ("bool", 64 * 127), C.LOGIT_INDICES: ("int64", 13)}
    # fp32 K/V rows are 4 x 16 x 4 = 256 bytes: always aligned. Logit rows (48 x 4 = 192 bytes) are not.
    assert set(scratch) == {C.LOGITS}
    _, scratch16 = buffer_layout(m16.graphs[C.TARGET_GRAPH].spec, profiles_of(m16, C.TARGET_GRAPH))
    # fp16 K/V rows are 128 bytes: a present view at an odd row is unaligned, so those outputs get scratch.
    assert set(scratch16) == {C.LOGITS, C.FEATURES, *C.present_names(2)}
    assert scratch16["present_key.0"] == ("float16", 64 * 4 * 16)


def test_plan_prefill_and_verify(m32):
    p = planners(m32)[C.TARGET_GRAPH]
    ins, outs = target_call(past=0, new=20, rows=1)
    plan = p.plan(ins, outs)
    assert plan.profile == 0 and plan.axes == {"batch": 1, "new_tokens": 20, "total_len": 20, "logit_rows": 1,
                                               "past_len": 0}
    by = {b.name: b for b in plan.inputs}
    assert by[C.ATTENTION_MASK].stage == "h2d" and by[C.ATTENTION_MASK].address == p.staging[C.ATTENTION_MASK].address
    assert by[C.ATTENTION_MASK].shape == (1, 20, 20)
    assert by["past_key.1"].shape == (1, 0, 4, 16) and by["past_key.1"].address == ins["past_key.1"].address
    outs_by = {b.name: b for b in plan.outputs}
    assert outs_by["present_value.1"].address == outs["present_value.1"].address and not outs_by[
        "present_value.1"].copy_back
    assert [b.name for b in plan.inputs] == m32.graphs[C.TARGET_GRAPH].spec.input_names

    ins, outs = target_call(past=37, new=13, rows=13)
    plan = p.plan(ins, outs)
    assert plan.profile == 1  # verify
    assert {b.name: b.shape for b in plan.outputs}[C.LOGITS] == (1, 13, 48)
    assert {b.name: b.address for b in plan.outputs}["present_key.0"] == 0x10_0000_0000 + 37 * 256

    ins, outs = target_call(past=37, new=1, rows=1)  # plain decode: the verify profile (smaller)
    assert p.plan(ins, outs).profile == 1


def test_plan_redirects_unaligned_present_rows(m16):
    p = planners(m16)[C.TARGET_GRAPH]
    ins, outs = target_call(past=5, new=13, rows=13, dtype="float16", row_bytes=128)
    plan = p.plan(ins, outs)
    by = {b.name: b for b in plan.outputs}
    for name in C.present_names(2):  # row 5 x 128 bytes = 640: not 256-aligned -> scratch, copied back after
        assert by[name].copy_back and by[name].address == p.scratch[name].address
    assert not by[C.LOGITS].copy_back  # the logits buffer starts at its base
    ins, outs = target_call(past=6, new=13, rows=13, dtype="float16", row_bytes=128)
    assert not any(b.copy_back for b in p.plan(ins, outs).outputs)  # 768 bytes: aligned, bound in place


@pytest.mark.parametrize("edit, message", [
    (lambda i, o: i.pop(C.LOGIT_INDICES), "inputs do not match the engine's: missing ['logit_indices']"),
    (lambda i, o: o.update(extra=desc((1,), "int64", BASE)), "unknown ['extra']"),
    (lambda i, o: i.update({C.INPUT_IDS: desc((1, 13), "int32", None)}), "input_ids is int32"),
    (lambda i, o: i.update({C.POSITION_IDS: desc((1, 12), "int64", None)}),
     "input position_ids gives new_tokens=12 but input_ids gives 13"),
    (lambda i, o: i.update({C.ATTENTION_MASK: desc((1, 13, 51), "bool", None)}),
     "attention_mask covers 51 keys, not past_len 37 + new_tokens 13"),
    (lambda i, o: i.update({"past_key.0": desc((1, 37, 4, 8), "float32", BASE)}),
     "past_key.0 has shape [1, 37, 4, 8], the contract says ['batch', 'past_len', 4, 16]"),
    (lambda i, o: o.update({C.LOGITS: desc((1, 12, 48), "float32", BASE)}),
     "output logits buffer is float32 [1, 12, 48], the engine writes float32 [1, 13, 48]"),
    (lambda i, o: o.update({C.LOGITS: desc((1, 13, 48), "float32", None)}), "logits must be a device tensor"),
    (lambda i, o: o.update({"present_key.0": desc((1, 13, 4, 16), "float32", BASE + 64)}),
     "present_key.0 is at an address not 256-byte aligned and has no scratch"),
    (lambda i, o: i.update({"past_key.0": desc((1, 37, 4, 16), "float32", BASE + 64)}),
     "past_key.0 is at an address not 256-byte aligned and has no staging buffer"),
])
def test_plan_errors(m32, edit, message):
    ins, outs = target_call(past=37, new=13, rows=13)
    edit(ins, outs)
    with pytest.raises(EngineError) as info:
        planners(m32)[C.TARGET_GRAPH].plan(ins, outs)
    assert str(info.value).startswith("target_verify: ") and message in str(info.value)


def test_plan_outside_every_profile(m32):
    ins, outs = target_call(past=20, new=14, rows=14)
    with pytest.raises(EngineError) as info:
        planners(m32)[C.TARGET_GRAPH].plan(ins, outs)
    msg = str(info.value)
    assert "new_tokens=14" in msg and "fits no optimisation profile" in msg
    assert "prefill: batch 1/1/1, new_tokens 1/64/64" in msg and "verify: batch 1/1/1, new_tokens 1/13/13" in msg
    assert "--max-prefill / --max-tree-tokens" in msg


def aligned_zeros(shape: tuple, dtype: torch.dtype, alignment: int = 256) -> torch.Tensor:
    """A zero CPU tensor whose data starts at a multiple of ``alignment`` bytes (torch's CPU allocator gives 64)."""
    n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.zeros(n + alignment, dtype=torch.uint8)
    off = -raw.data_ptr() % alignment
    return raw[off:off + n].view(dtype).view(shape)


class PlanningBackend:
    """ONNX Runtime runs the graphs; every call is also planned exactly as TrtBackend plans it. "Device memory"
    is what ``zeros`` allocated (256-byte aligned host memory); anything else is a host array to stage."""

    name = "ort+trt-plan"
    target_graph = "target_verify"
    tree_graph = None  # no tree graph engine here
    tree_depths: dict = {}
    fixed_tree_depth = True
    accepts_in_graph = False  # the ONNX Runtime graphs: no appended operators
    tree_selects: dict = {}
    device = "cpu"
    host_memory = True
    max_prefill = None
    last_exec_s = None
    open_s = 0.0  # the OrtBackend inside opens the standard graphs up front (no tree graph)

    def __init__(self, art, manifest):
        self.ort = OrtBackend(art, manifest, threads=1, fused=False, draft_tree=False)  # what the engines run
        self.planners = planners(manifest)
        for p in self.planners.values():
            p.is_device = self.is_device
        self.max_tree_tokens = manifest.engines.options["max_tree_tokens"]
        self._blocks: list[tuple[int, int]] = []
        self.calls = []

    def zeros(self, shape, dtype):
        t = aligned_zeros(shape, dtype)
        self._blocks.append((t.data_ptr(), t.numel() * t.element_size()))
        return t

    def is_device(self, v: BufferView) -> bool:
        return any(a <= v.address <= a + n for a, n in self._blocks)

    def check_tree(self, tree):
        TrtBackend.check_tree(self, tree)

    def run(self, graph, inputs, outputs):
        plan = self.planners[graph].plan(inputs, outputs)
        self.calls.append(plan)
        self.ort.run(graph, inputs, outputs)

    def to_host(self, x):
        return x.numpy()

    def copy_from_host(self, dst, src):
        dst.copy_(torch.from_numpy(src).reshape(dst.shape))

    def synchronize(self):
        pass


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_every_step_of_a_generation_is_planned(engines, dtype):
    """The real generator's calls (prefill in 3 chunks, draft context, tree levels, verify, no-draft decode)
    all fit the engines' profiles, and each binding points at the right buffer rows (or scratch)."""
    art = engines(dtype)
    m = load_manifest(art)
    be = PlanningBackend(art, m)
    gen = Generator(m, be, TokenEmbedding.open(art, m), prefill_chunk=16)
    tree = TreeParams(top_k=4, depth=3, total_tokens=12)
    prompt = [int(x) for x in np.random.default_rng(0).integers(3, 48, size=40)]
    eagle = list(itertools.chain.from_iterable(gen.run(prompt, 20, tree=tree, stop_on_eos=False)))
    plain = list(itertools.chain.from_iterable(gen.run(prompt, 20, use_draft=False, stop_on_eos=False)))
    assert eagle == plain and len(eagle) == 20  # the wrapper changes nothing; greedy EAGLE == plain decoding

    caches = {C.TARGET_GRAPH: gen.tcache, C.DRAFT_GRAPH: gen.dcache}
    used = {C.TARGET_GRAPH: set(), C.DRAFT_GRAPH: set()}
    staged = 0
    for plan in be.calls:
        graph = plan.graph
        used[graph].add(plan.profile)
        past, new = plan.axes["past_len"], plan.axes["new_tokens"]
        cache = caches[graph]
        layers = cache.num_layers
        by_in = {b.name: b for b in plan.inputs}
        by_out = {b.name: b for b in plan.outputs}
        for i, name in enumerate(C.past_names(layers)):
            assert by_in[name].address == cache.buffers[i].data_ptr() and by_in[name].shape[1] == past
        for i, name in enumerate(C.present_names(layers)):
            # New K/V land at row 0 of the cache's new-rows scratch (aligned: bound in place, never redirected).
            b = by_out[name]
            assert not b.copy_back and b.address == cache.new_buffers[i].data_ptr()
            assert b.shape[1] == new
        for b in plan.inputs:
            if b.stage:
                assert b.stage == "h2d" and b.address == be.planners[graph].staging[b.name].address
                staged += 1
        if graph == C.TARGET_GRAPH:
            rows = plan.axes["logit_rows"]
            assert by_out[C.LOGITS].address == gen.logits.data_ptr()
            if rows > 1:
                assert plan.profile == 1 and rows == new == tree.verify_tokens  # verify
            if new > tree.verify_tokens:
                assert plan.profile == 0  # a prefill chunk
        elif plan.axes["hidden_rows"] > 0:
            assert plan.profile == 1 and plan.axes["feature_rows"] == 0  # tree levels: the tree profile
        else:
            assert plan.profile == 0 and plan.axes["feature_rows"] == new  # context passes
    assert used == {C.TARGET_GRAPH: {0, 1}, C.DRAFT_GRAPH: {0, 1}}
    assert staged > 0
    first_target = next(p for p in be.calls if p.graph == C.TARGET_GRAPH)
    assert first_target.axes["past_len"] == 0 and first_target.axes["new_tokens"] == 16 and first_target.profile == 0


def test_generator_checks_the_tree_against_the_engines(engines):
    art = engines("fp32")
    m = load_manifest(art)
    be = PlanningBackend(art, m)
    be.max_tree_tokens = 8
    gen = Generator(m, be, TokenEmbedding.open(art, m))
    with pytest.raises(GenerationError, match=r"total_tokens=12 needs a verify of 13 tokens, but the engines were "
                                              r"built for at most 8 \(rebuild with a larger --max-tree-tokens\)"):
        gen.run([3, 4, 5], 4, tree=TreeParams(4, 3, 12))
    gen.run([3, 4, 5], 4, tree=TreeParams(4, 3, 7))  # fits


def test_check_tree_unit():
    stub = SimpleNamespace(max_tree_tokens=5)
    TrtBackend.check_tree(stub, TreeParams(2, 2, 4))
    with pytest.raises(GenerationError):
        TrtBackend.check_tree(stub, TreeParams(2, 2, 5))


def test_views_of_tensors():
    t = torch.zeros(1, 3, 4)
    assert view_of(t) == BufferView(t.data_ptr(), "float32", (1, 3, 4), "cpu", 0)
    assert view_of(torch.zeros(2, dtype=torch.bfloat16)).dtype == "bfloat16"  # bf16 has its entry
    assert view_of(np.ones((1, 2, 2), dtype=np.bool_))[1:] == ("bool", (1, 2, 2), "cpu", 0)
    with pytest.raises(ValueError, match="contiguous"):
        view_of(torch.zeros(4, 4).t())
    # An empty cache prefix (past_len 0) is bound at its buffer's base, never at torch's 0 for empty tensors.
    cache = torch.zeros(1, 10, 4, 16)
    assert cache[:, :0].data_ptr() == 0
    assert view_of(cache[:, :0]).address == cache.data_ptr()
    assert tensor_address(cache[:, 3:3]) == cache.data_ptr() + 3 * 4 * 16 * 4


def test_backends_implement_the_protocol(engines):
    from eagle_export.runtime.timing import TimingBackend
    from eagle_export.tools.testing.trt_emulator import emulated_backend

    art = engines("fp32")
    ort_be = OrtBackend(art, load_manifest(art), threads=1)
    trt_be = emulated_backend(art)  # the real TrtBackend class, its device seam swapped for the CPU emulator
    plan_be = PlanningBackend(art, load_manifest(art))
    for be in (ort_be, trt_be, plan_be, TimingBackend(ort_be), TimingBackend(trt_be)):
        assert isinstance(be, Backend), type(be).__name__
    assert type(trt_be) is TrtBackend
    members = [*Backend.__annotations__, *(m for m in vars(Backend) if not m.startswith("_"))]
    assert {"run", "zeros", "to_host", "check_tree", "synchronize", "max_prefill", "host_memory"} <= set(members)
    with pytest.raises(TypeError, match="does not implement runtime.backend.Backend"):
        Generator(load_manifest(art), SimpleNamespace(name="x", run=lambda *a: None),
                  TokenEmbedding.open(art, load_manifest(art)))


def test_no_getattr_on_a_backend_in_runtime():
    """Every Backend member is required: nothing in runtime/ probes a backend for an optional one."""
    import ast
    from pathlib import Path

    import eagle_export.runtime as R

    probes = []
    for path in Path(R.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr") and node.args:
                target = ast.unparse(node.args[0])
                if "backend" in target or target in ("be", "inner"):
                    probes.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not probes, probes


def test_open_without_engines_is_a_clear_error(engines, tmp_path):
    art = shutil.copytree(engines.artifact("fp32"), tmp_path / "art")
    with pytest.raises(EngineError, match=f"{art} has no TensorRT engines: run `eagle-export build {art}` first"):
        EagleRuntime.open(art, backend="tensorrt")


def test_open_with_a_missing_engine_file(engines, tmp_path):
    art = shutil.copytree(engines("fp32"), tmp_path / "art")
    (art / "draft_step.engine").unlink()
    with pytest.raises(EngineError, match="engine file draft_step.engine of graph draft_step is missing"):
        EagleRuntime.open(art, backend="tensorrt")


def test_open_with_a_truncated_engine_file(engines, tmp_path):
    art = shutil.copytree(engines("fp32"), tmp_path / "art")
    engine = art / "target_verify.engine"
    engine.write_bytes(engine.read_bytes()[:1000])
    with pytest.raises(EngineError, match="engine file target_verify.engine of graph target_verify is 1000 bytes but "
                                          r"was built as \d+ \(truncated or corrupt\?\)"):
        EagleRuntime.open(art, backend="tensorrt")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the no-CUDA error cannot happen")
def test_no_cuda_is_a_clear_error(engines):
    with pytest.raises(EagleExportError) as info:
        EagleRuntime.open(engines("fp32"), backend="tensorrt")
    assert "torch sees no CUDA device" in str(info.value) and "--backend ort" in str(info.value)
    res = CliRunner().invoke(main, ["generate", str(engines("fp32")), "--prompt-ids", "3,4,5", "--backend",
                                    "tensorrt"])
    assert res.exit_code == 2 and res.output.startswith("error: the tensorrt backend runs engines on an NVIDIA GPU")
    assert "Traceback" not in res.output


def test_ort_refuses_bf16(engines):
    with pytest.raises(EagleExportError, match="bfloat16 graphs, which the ort backend cannot run"):
        EagleRuntime.open(engines.artifact("bf16"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_tensorrt_generation_equals_ort(engines, dtype):  # pragma: no cover - needs a GPU
    from reference import FP16_TIE_GAP, TIE_GAP, Comparison, GreedyReference

    art = engines.for_this_gpu(dtype)  # a library that runs on this GPU (not CI's TensorRT-RTX build on an H200)
    trt_rt = EagleRuntime.open(art, backend="tensorrt")
    ort_rt = EagleRuntime.open(art, backend="ort", providers=["CPUExecutionProvider"])
    ref = GreedyReference(engines.sources(dtype)[0])  # transformers, fp32, on the original checkpoint
    cmp = Comparison()
    for prompt in ([3, 9, 27], list(range(3, 40))):
        want = ref.generate(prompt, 20)
        for use_draft in (True, False):
            a = trt_rt.generate(prompt_ids=prompt, max_new_tokens=20, use_draft=use_draft, stop_on_eos=False)
            b = ort_rt.generate(prompt_ids=prompt, max_new_tokens=20, use_draft=use_draft, stop_on_eos=False)
            if dtype == "fp32":
                assert a.tokens == b.tokens
            # A divergence from transformers is allowed only at a measured near-tie of its logits (then the rest
            # of the sequence is not compared); fp16 kernels differ between providers, so fp16 takes the fp16 gap.
            ref.compare(prompt, a.tokens, want, cmp, f"tensorrt {dtype} {'eagle' if use_draft else 'no-draft'}",
                        tie_gap=TIE_GAP if dtype == "fp32" else FP16_TIE_GAP)
    print(f"\ntensorrt {dtype}: {cmp.tokens} tokens equal to transformers, {cmp.ties} ties")
    assert not cmp.failures, "\n".join(cmp.failures)
    assert cmp.ties <= (0 if dtype == "fp32" else 2), cmp
