"""The TensorRT backend end to end on the CPU: real TensorRT-RTX engines (built in CI), executed by the emulator
of ``tools/testing/trt_emulator.py``, which enforces TensorRT's rules for every call and runs the engines' source ONNX
graphs with ONNX Runtime over exactly the memory the backend bound.

Full generations through ``TrtBackend``: greedy equal to transformers, sampling equal to ONNX Runtime with the
same seed, prompts longer than --max-prefill, a 1-token prompt, capacity reached, fp16, bf16, EAGLE-1/2 and
EAGLE-3 heads; planted rule violations fail with their rule's message.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from reference import Comparison, GreedyReference

from eagle_export import contract as C
from eagle_export.errors import EngineError
from eagle_export.runtime import EagleRuntime
from eagle_export.runtime.backend import Backend
from eagle_export.runtime.sampling import SamplingParams
from eagle_export.runtime.trt_backend import TrtBackend
from eagle_export.tools.testing.trt_emulator import RuleViolation, TrtEmulator, emulated_runtime
from eagle_export.tree_params import TreeParams

TREE = TreeParams(top_k=4, depth=3, total_tokens=12)  # the engines' largest verify (13 tokens)
CHAIN = TreeParams(top_k=1, depth=3, total_tokens=3)


def prompts(vocab: int, lengths=(1, 23, 40), seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(3, vocab, size=n)] for n in lengths]


def ort_runtime(art) -> EagleRuntime:
    return EagleRuntime.open(art, threads=1)


def test_greedy_is_transformers_greedy_with_chunked_prefill(engines):
    """fp32 engines built with --max-prefill 16: a 40-token prompt is prefilled in 3 chunks (16, 16, 8)."""
    target, _, _ = engines.sources("fp32")
    art = engines("fp32", max_prefill=16)
    rt = emulated_runtime(art)
    assert isinstance(rt.backend, TrtBackend) and isinstance(rt.backend, Backend)
    assert rt.generator.chunk == 16
    ref = GreedyReference(target)
    cmp = Comparison()
    vocab = rt.manifest.target.vocab_size
    for prompt in prompts(vocab):
        want = ref.generate(prompt, 20)
        for tree in (TREE, CHAIN):
            got = rt.generate(prompt_ids=prompt, max_new_tokens=20, tree=tree, stop_on_eos=False)
            ref.compare(prompt, got.tokens, want, cmp, f"eagle {tree}")
        plain = rt.generate(prompt_ids=prompt, max_new_tokens=20, use_draft=False, stop_on_eos=False)
        ref.compare(prompt, plain.tokens, want, cmp, "no-draft")
    assert not cmp.failures, cmp.failures
    assert cmp.tokens >= 3 * 3 * 20 - 20
    # Both profiles of every engine ran (the default tree's tree engine for TREE, the step graph level by level for
    # CHAIN, whose top_k has no tree engine), and prefill chunks never exceeded the prefill profile.
    emu = rt.backend.emulator
    used = {(g, p) for g, p, _ in emu.executions}
    call = C.tree_call(4, 3)
    assert used == {(C.TARGET_GRAPH, 0), (C.TARGET_GRAPH, 1), (C.DRAFT_GRAPH, 0), (C.DRAFT_GRAPH, 1), (call, 0),
                    (call, 1)}
    assert max(a[C.NEW_TOKENS] for g, p, a in emu.executions if g == C.TARGET_GRAPH and p == 0) == 16


def test_a_round_drafts_in_one_tree_engine_call(engines):
    """`build` made an engine of the draft tree graph cut to the default tree's depth (top_k 4, depth 3): a round of
    that tree is one verify and one tree engine call (the context pass that grows the next tree), no step graph
    call; a shallower tree of the same top_k runs the same engine and reads its first levels. The rounds accept
    exactly what ONNX Runtime's tree graph (cut to each tree's depth) accepts, tokens and accepted lengths alike.
    Host reads (each waits for the device): the default tree's round selects and accepts in the engines and reads
    once, its accepted path; the shallower tree's selects on the host from one read of the tree engine's outputs
    and reads the verify's argmax. Planted bugs this fails on: candidates read at the round's depth from an engine
    grown deeper (a wrong row stride), the tree engine not used (step graph calls), a wrong cut, a wrong selection
    or acceptance in the engines (other accepted lengths), a read per tree output. This random model accepts a few
    drafts only: tests/test_batched.py checks the device rounds' acceptance on a drafting pair."""
    art = engines("fp32")
    trt_rt, ort_rt = emulated_runtime(art, guard=False), EagleRuntime.open(art, threads=1, guard=False)
    emu = trt_rt.backend.emulator
    call = C.tree_call(4, 3)
    assert trt_rt.backend.tree_depths == {4: 3} and trt_rt.backend.tree_selects == {4: 12}
    assert trt_rt.backend.accepts_in_graph
    shallow = TreeParams(top_k=4, depth=2, total_tokens=8)
    reads = {}
    for tree in (TREE, shallow, CHAIN):
        for prompt in prompts(trt_rt.manifest.target.vocab_size, lengths=(5, 23)):
            emu.executions.clear()
            before = emu.mem.host_reads
            a = trt_rt.generate(prompt_ids=prompt, max_new_tokens=20, tree=tree, stop_on_eos=False)
            b = ort_rt.generate(prompt_ids=prompt, max_new_tokens=20, tree=tree, stop_on_eos=False)
            assert a.tokens == b.tokens and a.stats.accept_lengths == b.stats.accept_lengths, tree
            ran = [g for g, _, _ in emu.executions]
            rounds, got = a.stats.rounds, emu.mem.host_reads - before
            reads[tree] = got / rounds
            # The prefill's one chunk, then each round's verify; the context pass after every round but the last
            if tree.top_k == 4:  # one tree engine call (it grows the next tree), never the step graph
                assert ran.count(C.TARGET_GRAPH) == rounds + 1 and ran.count(call) == rounds
                assert C.DRAFT_GRAPH not in ran
            else:  # no tree engine for top_k 1: a context pass, then one call per level (2: 1/3/3 drafts as 1/2/3)
                assert call not in ran and ran.count(C.DRAFT_GRAPH) == rounds + 2 * rounds
            if tree == TREE:  # the prefill's first token, then one read a round: the accepted path
                assert got == 1 + rounds
            elif tree == shallow:  # + the prefill's tree, then the argmax and (but the last) the candidates
                assert got == 2 + rounds + (rounds - 1)
    print(f"\nhost reads a round: engines select and accept {reads[TREE]:.2f} (4/3/12); host selects from the tree "
          f"engine {reads[shallow]:.2f} (4/2/8); step graph {reads[CHAIN]:.2f} (1/3/3)")


def test_a_planted_host_read_inside_a_device_round_fails_the_read_count(engines, monkeypatch):
    """The check above counts every host read of a round: one more inside the device round's verify (the
    candidates read, as the host path does) breaks it."""
    from eagle_export.runtime.generator import Generator

    rt = emulated_runtime(engines("fp32"), guard=False)
    mem = rt.backend.emulator.mem

    def count() -> tuple[int, int]:
        before = mem.host_reads
        out = rt.generate(prompt_ids=[5, 6, 7, 8], max_new_tokens=12, tree=TREE, stop_on_eos=False)
        return mem.host_reads - before, out.stats.rounds

    reads, rounds = count()
    assert reads == 1 + rounds
    real = Generator._verify_on_device
    monkeypatch.setattr(Generator, "_verify_on_device",
                        lambda self, s: (self.backend.to_host(self._x["scores"][:1]), real(self, s))[1])
    reads, rounds = count()
    assert reads == 1 + 2 * rounds  # the planted read shows in the count


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_sampling_equals_onnx_runtime_with_the_same_seed(engines, dtype):
    art = engines(dtype)
    trt_rt, ort_rt = emulated_runtime(art), ort_runtime(art)
    sampling = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=7)
    for prompt in prompts(trt_rt.manifest.target.vocab_size, lengths=(1, 17)):
        for use_draft in (True, False):
            a = trt_rt.generate(prompt_ids=prompt, max_new_tokens=16, tree=TREE, use_draft=use_draft,
                                sampling=sampling, stop_on_eos=False)
            b = ort_rt.generate(prompt_ids=prompt, max_new_tokens=16, tree=TREE, use_draft=use_draft,
                                sampling=sampling, stop_on_eos=False)
            assert a.tokens == b.tokens and a.stats.accept_lengths == b.stats.accept_lengths


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_capacity_and_one_token_prompts_equal_onnx_runtime(engines, dtype):
    art = engines(dtype)
    trt_rt, ort_rt = emulated_runtime(art), ort_runtime(art)
    capacity = trt_rt.manifest.max_seq_len
    long = [3 + i % 40 for i in range(capacity - 9)]  # 9 tokens from the capacity: a round crosses it
    for prompt, use_draft in itertools.product(([5], long), (True, False)):
        a = trt_rt.generate(prompt_ids=prompt, max_new_tokens=capacity, tree=TREE, use_draft=use_draft,
                            stop_on_eos=False)
        b = ort_rt.generate(prompt_ids=prompt, max_new_tokens=capacity, tree=TREE, use_draft=use_draft,
                            stop_on_eos=False)
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason == "capacity"
        assert len(prompt) + len(a.tokens) == capacity


def test_eagle3_head(engines):
    art = engines("fp32", eagle3=True)
    trt_rt, ort_rt = emulated_runtime(art), ort_runtime(art)
    assert trt_rt.manifest.variant == "eagle3"
    for prompt in prompts(trt_rt.manifest.target.vocab_size, lengths=(1, 30)):
        a = trt_rt.generate(prompt_ids=prompt, max_new_tokens=24, tree=TREE, stop_on_eos=False)
        b = ort_rt.generate(prompt_ids=prompt, max_new_tokens=24, tree=TREE, stop_on_eos=False)
        plain = trt_rt.generate(prompt_ids=prompt, max_new_tokens=24, use_draft=False, stop_on_eos=False)
        assert a.tokens == b.tokens == plain.tokens


def test_bf16_opens_and_generates(engines):
    """bf16 runs only on TensorRT (ONNX Runtime refuses it: tests/test_trt_backend.py::test_ort_refuses_bf16).
    Emulated, the graph computes in fp32 from the bf16 memory the backend bound: EAGLE equals plain decoding."""
    art = engines("bf16")
    rt = emulated_runtime(art)
    assert rt.manifest.dtype == "bfloat16" and rt.generator.tcache.buffers[0].dtype == torch.bfloat16
    for prompt in prompts(rt.manifest.target.vocab_size, lengths=(1, 20)):
        eagle = rt.generate(prompt_ids=prompt, max_new_tokens=20, tree=TREE, stop_on_eos=False)
        plain = rt.generate(prompt_ids=prompt, max_new_tokens=20, use_draft=False, stop_on_eos=False)
        assert eagle.tokens == plain.tokens and len(eagle.tokens) == 20


# ---- planted violations: the emulator catches a backend that breaks TensorRT's rules ------------------------


def test_a_call_outside_its_profile_fails_with_the_profile_rule(engines, monkeypatch):
    """Planted: the target's profile choice always takes the prefill profile, so a tree verify (13 logit rows) is
    set on a context whose profile admits 1: set_input_shape fails and the error carries the rule's message."""
    import eagle_export.runtime.trt_backend as T

    real = T.choose_profile
    monkeypatch.setattr(T, "choose_profile", lambda profiles, axes: 0 if "logit_rows" in axes else real(profiles, axes))
    rt = emulated_runtime(engines("fp32"))
    with pytest.raises(EngineError) as info:
        rt.generate(prompt_ids=[3, 4, 5], max_new_tokens=8, tree=TREE, stop_on_eos=False)
    msg = str(info.value)
    assert "TensorRT refused shape" in msg and "TensorRT rule broken (profile" in msg
    assert "outside profile 0 (prefill): logit_rows=13 not in [1, 1]" in msg


def test_an_unaligned_output_goes_through_scratch_and_a_planted_alignment_bug_breaks_the_rule(engines, monkeypatch):
    """A prefill call by hand with the logits bound 64 bytes into their buffer. The backend writes them to its
    scratch and copies them into place (the same values as an aligned call); planted: the planner believes 64
    bytes suffice, binds the address directly, and the emulator refuses it with the alignment rule."""
    rt = emulated_runtime(engines("fp32"))
    gen, be = rt.generator, rt.backend
    layers = rt.manifest.target.num_layers

    def call(shift: int) -> np.ndarray:
        gen._ids.array[:3] = [3, 4, 5]
        gen._pos.array[:3] = [0, 1, 2]
        gen._causal(3, 0)
        gen._lidx.array[0] = 2
        fixed, outs = gen._target_io(1, 3, 1)  # batch 1, 3 new rows, 1 logits row
        outs = dict(outs)
        outs[C.LOGITS] = outs[C.LOGITS]._replace(address=outs[C.LOGITS].address + shift)
        inputs = {**fixed, C.ATTENTION_MASK: gen._mask.view((1, 3, 3)),
                  **dict(zip(C.past_names(layers), gen.tcache.views(0, 0), strict=True))}
        be.run(C.TARGET_GRAPH, inputs, outs)
        flat = be.to_host(gen.logits.view(-1))
        return flat[shift // 4:shift // 4 + rt.manifest.target.vocab_size]

    aligned = call(0)
    np.testing.assert_array_equal(call(64), aligned)
    for g in be.graphs.values():
        monkeypatch.setattr(g.planner, "alignment", 64)
        g.plans.clear()
    # TensorRT refuses the address (set_tensor_address returns False and logs why); the backend says so instead of
    # running with the previous address still bound.
    with pytest.raises(EngineError, match=r"target_verify: TensorRT rejected address 0x[0-9a-f]+ for logits \(profile "
                                          r"0\): TensorRT rule broken \(alignment: tensor addresses are 256-byte "
                                          r"aligned\): target_verify: logits at 0x[0-9a-f]+ \(64 bytes past"):
        call(64)


def test_reading_outputs_before_the_stream_syncs_reads_poison(engines, monkeypatch):
    """Planted: the backend no longer orders the caller's stream after its own (caller.wait_stream dropped). The
    host read of the prefill's first token (the verify engine's argmax) comes before the queued call has run: it reads
    poison (-1), as a GPU would read whatever the memory held, the loop says so in one line, and the emulator names
    the call whose writes it missed."""
    rt = emulated_runtime(engines("fp32"))
    mem = rt.backend.mem
    monkeypatch.setattr(type(mem.default), "wait_stream", lambda self, other: None)
    with pytest.raises(ValueError, match="argmax read back as -1, outside the vocabulary"):
        rt.generate(prompt_ids=[3, 4, 5], max_new_tokens=4, tree=TREE, stop_on_eos=False)
    assert any(r.startswith("a host read of") and f"before {C.TARGET_GRAPH} (profile 0) wrote them" in r
               for r in mem.poisoned_reads), mem.poisoned_reads[:3]


def test_two_contexts_on_one_profile_fail_with_the_own_profile_rule(engines):
    art = engines("fp32")
    from eagle_export.manifest import load_manifest

    emu = TrtEmulator(art, load_manifest(art))
    be = emu.backend()
    ctx = be.graphs[C.TARGET_GRAPH].engine.create_execution_context()
    with pytest.raises(RuleViolation, match=r"own-profile.*profile 1 already belongs to another execution context"):
        ctx.set_optimization_profile_async(1, be.stream.cuda_stream)


# ---- what the backend does for a real GPU (issue 16's defects), shown on the emulator -------------------------


def test_engines_of_a_library_that_cannot_run_on_the_gpu_are_refused(engines):
    """TensorRT-RTX engines on a Hopper GPU (compute capability 9.0): one clear line naming the fix."""
    from eagle_export.tools.testing.trt_emulator import emulated_backend

    art = engines("fp32")
    with pytest.raises(EngineError) as info:
        emulated_backend(art, compute_capability=(9, 0))
    msg = str(info.value)
    assert "were built with tensorrt_rtx 1.7.1.116, which cannot run on this GPU (emulated GPU, compute capability " \
           "9.0): tensorrt_rtx cannot run on compute capability 9.0" in msg
    assert f"`eagle-export build {art} --engine-lib tensorrt`" in msg
    emulated_backend(art, compute_capability=(12, 0))  # an RTX 50xx: fine


def test_all_contexts_share_one_block_of_context_memory(engines):
    rt = emulated_runtime(engines("fp32"))
    contexts = [c for g in rt.backend.graphs.values() for c in g.contexts]
    assert len(contexts) == 6  # two profiles each: target, draft step, the default tree's tree engine
    assert {c.device_memory for c in contexts} == {(rt.backend.context_memory.data_ptr(),
                                                    rt.backend.context_memory.numel())}
    assert all(c.strategy.name == "USER_MANAGED" for c in contexts)
    rt.generate(prompt_ids=[3, 4, 5], max_new_tokens=8, tree=TREE, stop_on_eos=False)  # the checks hold in calls


def test_a_repeated_call_shape_sets_only_what_changed(engines):
    """Plans are cached per call shape and a context is given only the shapes and addresses that changed: the
    same generation again sets no address and reads no output shape, and sets only the input shapes that moved
    (the cache prefix grows every call)."""
    rt = emulated_runtime(engines("fp32"), guard=False)  # the same rounds both times
    contexts = [c for g in rt.backend.graphs.values() for c in g.contexts]

    def counts():
        return {k: sum(c.calls[k] for c in contexts) for k in contexts[0].calls}

    prompt = prompts(rt.manifest.target.vocab_size, lengths=(20,))[0]
    rt.generate(prompt_ids=prompt, max_new_tokens=24, tree=TREE, stop_on_eos=False)
    first = counts()
    rt.generate(prompt_ids=prompt, max_new_tokens=24, tree=TREE, stop_on_eos=False)
    second = {k: v - first[k] for k, v in counts().items()}
    calls = second["execute_async_v3"]
    names = {g: len(rt.manifest.graphs[g].spec.input_names) for g in rt.manifest.graphs}
    assert calls == first["execute_async_v3"] > 20
    assert second["set_tensor_address"] == 0 and second["get_tensor_shape"] == 0
    # Each call sets at most its past_* views (2 per layer) plus the mask and the row-count inputs (a tree engine's
    # call moves 6 of its 7 inputs: the context rows and the cache), well under every input of every call.
    assert second["set_input_shape"] < calls * max(names.values()) * 0.6
    print(f"\nper call, a repeated generation: {second['set_input_shape'] / calls:.1f} set_input_shape, "
          f"0 set_tensor_address, 0 get_tensor_shape (first generation: {first['set_tensor_address'] / calls:.1f} "
          "set_tensor_address)")


def test_the_staging_event_is_recorded_when_a_later_input_fails(engines):
    """A call whose mask is outside every profile's range after the ids were staged: the staging copies are still
    fenced by the event, so the next call waits for them before reusing the pinned buffers."""
    rt = emulated_runtime(engines("fp32"))
    gen, be = rt.generator, rt.backend
    layers = rt.manifest.target.num_layers
    g = be.graphs[C.TARGET_GRAPH]
    ctx = g.contexts[0]
    ctx.set_input_shape = lambda name, shape, real=ctx.set_input_shape: name != C.POSITION_IDS and real(name, shape)
    fixed, outs = gen._target_io(1, 3, 1)  # batch 1, 3 new rows, 1 logits row
    inputs = {**fixed, C.ATTENTION_MASK: gen._mask.view((1, 3, 3)),
              **dict(zip(C.past_names(layers), gen.tcache.views(0, 0), strict=True))}
    assert not g.h2d_pending
    with pytest.raises(EngineError, match="TensorRT refused shape"):
        be.run(C.TARGET_GRAPH, inputs, outs)
    assert g.h2d_pending and g.h2d_done.stream is be.stream


def test_debug_sync_names_the_graph_and_profile_of_a_device_fault(engines):
    art = engines("fp32")
    faulty = lambda graph, profile, axes: graph == C.TARGET_GRAPH and profile == 1  # noqa: E731 - the verify
    rt = emulated_runtime(art)
    rt.backend.emulator.fault_on = faulty
    with pytest.raises(RuntimeError, match="illegal memory access") as info:  # later, naming nothing
        rt.generate(prompt_ids=[3, 4, 5], max_new_tokens=8, tree=TREE, stop_on_eos=False)
    assert not isinstance(info.value, EngineError)
    rt = emulated_runtime(art, debug_sync=True)
    rt.backend.emulator.fault_on = faulty
    with pytest.raises(EngineError, match=r"target_verify: the call failed on the device \(profile 1, verify; axes "
                                          r".*\): CUDA error: an illegal memory access was encountered"):
        rt.generate(prompt_ids=[3, 4, 5], max_new_tokens=8, tree=TREE, stop_on_eos=False)


def test_tensorrt_rtx_runtime_configuration_and_cache(engines, tmp_path, caplog):
    """Contexts are made from a runtime config (user-managed memory, no per-shape JIT specialisation by default),
    with a runtime cache that is written by save_runtime_cache and read back by the next process."""
    from eagle_export.tools.testing.trt_emulator import emulated_backend

    art = engines("fp32")
    be = emulated_backend(art, runtime_cache_dir=tmp_path)
    configs = [c.runtime_config for g in be.graphs.values() for c in g.contexts]
    assert all(c is not None and c.dynamic_shapes_kernel_specialization_strategy.name == "NONE" for c in configs)
    assert all(c.runtime_cache is not None and not c.runtime_cache.loaded for c in configs)
    be.save_runtime_cache()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft_step.engine.runtime_cache",
                                                         "draft_tree_k4_d3.engine.runtime_cache",
                                                         "target_verify.engine.runtime_cache"]
    nowhere = emulated_backend(art, runtime_cache_dir=tmp_path / "missing")
    with caplog.at_level("WARNING", logger="eagle_export"):
        nowhere.save_runtime_cache()  # an unwritable place is a warning, never an error (also at exit)
    assert "could not write the TensorRT-RTX runtime cache" in caplog.text
    again = emulated_backend(art, runtime_cache_dir=tmp_path, rtx_shape_strategy="lazy")
    configs = [c.runtime_config for g in again.graphs.values() for c in g.contexts]
    assert all(c.runtime_cache.loaded and c.dynamic_shapes_kernel_specialization_strategy.name == "LAZY"
               for c in configs)


def test_a_context_that_misses_what_another_was_given_breaks_a_rule(engines):
    """Planted: the memo of what each context was given is shared by the contexts of a graph, so a context skips
    shapes and addresses only another context received: the emulator catches the first call on the second."""
    rt = emulated_runtime(engines("fp32"))
    for g in rt.backend.graphs.values():
        shapes, addresses = {}, {}
        g.shapes = [shapes] * len(g.shapes)
        g.addresses = [addresses] * len(g.addresses)
    # The first verify (profile 1) gets the shapes that differ from the prefill's, but no address.
    with pytest.raises(RuleViolation, match=r"TensorRT rule broken \(address-set: .*\): target_verify: no address "
                                            r"for \[.*'logit_indices', 'past_key.0'"):
        rt.generate(prompt_ids=[3, 4, 5], max_new_tokens=8, tree=TREE, stop_on_eos=False)


def test_bench_proxy_times_the_tensorrt_backend_around_run_and_synchronize(engines):
    """bench's TimingBackend over TrtBackend (last_exec_s None): every call is synchronised and timed, so queued
    device work counts as the graph's; the generation is unchanged."""
    from eagle_export.runtime.timing import TimingBackend

    rt = emulated_runtime(engines("fp32"))
    want = rt.generate(prompt_ids=[3, 4, 5], max_new_tokens=12, tree=TREE, stop_on_eos=False)
    proxy = TimingBackend(rt.backend)
    rt.generator.backend = proxy
    syncs = []
    real = rt.backend.synchronize
    rt.backend.synchronize = lambda: (syncs.append(1), real())[1]
    got = rt.generate(prompt_ids=[3, 4, 5], max_new_tokens=12, tree=TREE, stop_on_eos=False)
    assert got.tokens == want.tokens
    calls = proxy.calls[C.TARGET_GRAPH] + proxy.calls[C.DRAFT_GRAPH]
    assert proxy.calls[C.TARGET_GRAPH] == got.stats.rounds + 1 and len(syncs) == calls
    assert all(v > 0 for v in proxy.seconds.values())


# ---- the emulator's own rules: each one broken on purpose, by one call, must be reported ------------------------


class _Call:
    """A valid call of the target graph's prefill profile made by hand through the emulated TensorRT API, on a fresh
    engine object (its profiles owned by no context yet) of a runtime that has run: the shapes, addresses and
    context memory the backend gave its own prefill context, given again through the public calls. A case breaks
    one thing and expects that rule's error."""

    def __init__(self, rt: EagleRuntime):
        from eagle_export.tools.testing.trt_emulator import EmulatedEngine, ExecutionContextAllocationStrategy

        self.rt, self.be, self.mem = rt, rt.backend, rt.backend.mem
        self.src = self.be.graphs[C.TARGET_GRAPH].contexts[0]  # the prefill context: profile 0, the last prefill's
        self.engine = EmulatedEngine(self.be.emulator, C.TARGET_GRAPH, self.src.engine.logger)
        self.strategy = ExecutionContextAllocationStrategy.USER_MANAGED
        self.stream = self.be.stream.cuda_stream
        self.logger = self.src.engine.logger
        self.logger.reset()

    def context(self, skip: str | None = None, shapes: dict | None = None, memory: bool = True):
        ctx = self.engine.create_execution_context(self.strategy)
        assert ctx.set_optimization_profile_async(self.src.profile, self.stream)
        if memory:
            ctx.set_device_memory(*self.src.device_memory)
        for name, shape in {**self.src.shapes, **(shapes or {})}.items():
            if name != skip:
                assert ctx.set_input_shape(name, shape), self.logger.errors
        for name, address in self.src.addresses.items():
            if name != skip:
                assert ctx.set_tensor_address(name, address), self.logger.errors
        return ctx

    def run(self, ctx) -> bool:
        return ctx.execute_async_v3(self.stream)

    def refused(self, rule: str, ok: bool) -> None:
        """A call TensorRT refuses by its return value: False, and the rule's message logged."""
        assert ok is False and any(f"TensorRT rule broken ({rule}:" in m for m in self.logger.errors), \
            self.logger.errors
        raise RuleViolation(rule, "refused by return value")

    def logits_row(self) -> np.ndarray:
        """Row 0 of the logits buffer (where the prefill call writes its one row), read on the caller's stream."""
        return self.mem.to_host(self.rt.generator.logits).reshape(-1, self.rt.manifest.target.vocab_size)[0].copy()

    def empty_input(self) -> str:
        return next(t.name for t in self.engine.spec.inputs if 0 in self.src.shapes[t.name])

    def host_buffer(self, nbytes: int) -> int:
        """Aligned memory that is not device memory (not allocated through the emulated CUDA)."""
        self._host = torch.zeros(nbytes + 512, dtype=torch.uint8)
        return self._host.data_ptr() + (-self._host.data_ptr() % 256)


def _freed_runtime_config(c: _Call) -> bool:
    cfg = c.engine.create_runtime_config()
    cfg.set_execution_context_allocation_strategy(c.strategy)
    ctx = c.engine.create_execution_context(cfg)
    ctx.set_optimization_profile_async(c.src.profile, c.stream)
    ctx.set_device_memory(*c.src.device_memory)
    for name, shape in c.src.shapes.items():
        ctx.set_input_shape(name, shape)
    for name, address in c.src.addresses.items():
        ctx.set_tensor_address(name, address)
    del cfg
    return c.run(ctx)


def _read_before_sync(c: _Call) -> None:
    """An output read on the caller's stream while the call that writes it is still queued on the backend's: the
    read sees poison (NaN logits), and the emulator names the call."""
    ctx = c.context()
    assert c.run(ctx)
    seen = len(c.mem.poisoned_reads)
    assert np.isnan(c.logits_row()).all()  # the logits the prefill call writes, read before it ran
    assert any("before target_verify (profile 0) wrote them" in r for r in c.mem.poisoned_reads[seen:]), \
        c.mem.poisoned_reads[seen:]
    c.be.stream.synchronize()
    assert not np.isnan(c.logits_row()).any()
    raise RuleViolation("sync", "read poison")


def _input_written_on_another_stream(c: _Call) -> None:
    """The ids copied in on another stream, which the backend's stream does not wait for: the engine reads them
    before the copy has run, as poison (0xFF bytes: ids -1), and the emulator names the copy. The logits equal those
    of a call given ids -1 for real."""
    n = math.prod(c.src.shapes[C.INPUT_IDS])
    ids = c.mem.zeros((n,), torch.int64)
    other = c.mem.stream()
    with c.mem.on(other):
        c.mem.copy(ids, torch.arange(3, 3 + n, dtype=torch.int64))
    seen = len(c.mem.poisoned_reads)
    ctx = c.context()
    assert ctx.set_tensor_address(C.INPUT_IDS, ids.data_ptr()) and c.run(ctx)
    c.be.stream.synchronize()
    assert any(r.startswith("target_verify (profile 0) read") and "before a copy wrote them" in r
               for r in c.mem.poisoned_reads[seen:]), c.mem.poisoned_reads[seen:]
    poisoned = c.logits_row()
    other.synchronize()
    c.mem.copy(ids, torch.full((n,), -1, dtype=torch.int64))  # the caller's stream: done at once
    assert c.run(ctx)
    c.be.stream.synchronize()
    np.testing.assert_array_equal(poisoned, c.logits_row())
    raise RuleViolation("sync", "read poison")


def _bind_to(c: _Call, name: str, address: int) -> bool:
    ctx = c.context()
    assert ctx.set_tensor_address(name, address)
    return c.run(ctx)


# rule -> ways to break it (each: _Call -> the call that must fail)
BREAKS = {
    "shape-set": [lambda c: c.run(c.context(skip=C.POSITION_IDS)),
                  lambda c: c.refused("shape-set", c.context().set_input_shape(C.LOGITS, (1, 1, 8)))],
    "profile": [lambda c: c.refused("profile", c.context().set_input_shape(C.INPUT_IDS, (1, 10_000))),
                # two inputs that disagree on a shared axis (past_len), each inside the profile
                lambda c: c.run(c.context(shapes={C.past_key(0): (1, 1, *c.src.shapes[C.past_key(0)][2:])}))],
    "own-profile": [lambda c: (c.context(), c.context()),  # a second context asks for the first one's profile
                    lambda c: c.run(c.engine.create_execution_context(c.strategy))],  # no profile at all
    "address-set": [lambda c: c.run(c.context(skip=C.LOGITS)),
                    lambda c: c.refused("address-set", c.context().set_tensor_address("no_such_tensor", 1 << 20))],
    "alignment": [lambda c: c.context().set_device_memory(c.src.device_memory[0] + 64, c.src.device_memory[1]),
                  lambda c: c.refused("alignment", c.context().set_tensor_address(
                      C.INPUT_IDS, c.src.addresses[C.INPUT_IDS] + 64))],
    "empty": [lambda c: _bind_to(c, c.empty_input(), 0),
              lambda c: _bind_to(c, c.empty_input(), c.src.addresses[C.INPUT_IDS])],
    "device-memory": [lambda c: _bind_to(c, C.INPUT_IDS, c.host_buffer(4096)),
                      # 3 ids (24 bytes) from the start of an 8-byte device buffer: past its end
                      lambda c: _bind_to(c, C.INPUT_IDS, c.mem.zeros((1,), torch.int64).data_ptr()),
                      lambda c: c.context().execute_async_v3(0xBAD),
                      lambda c: (ctx := c.context(), ctx.set_device_memory(c.host_buffer(c.src.device_memory[1]),
                                                                           c.src.device_memory[1]), c.run(ctx))],
    "context-memory": [lambda c: c.run(c.context(memory=False)),
                       lambda c: (ctx := c.context(), ctx.set_device_memory(c.src.device_memory[0], 256),
                                  c.run(ctx)),
                       # a tensor bound inside the context's memory (a device allocation, aligned)
                       lambda c: _bind_to(c, C.INPUT_IDS, c.src.device_memory[0] + 256)],
    "sync": [_read_before_sync, _input_written_on_another_stream],
    "dtype": [lambda c: _bind_to(c, C.INPUT_IDS, c.mem.zeros((1024,), torch.float32).data_ptr())],
    "runtime-config": [_freed_runtime_config],
}


@pytest.fixture(scope="module")
def ran(engines) -> EagleRuntime:
    rt = emulated_runtime(engines("fp32"))
    rt.generate(prompt_ids=[3, 4, 5], max_new_tokens=4, tree=TREE, stop_on_eos=False)
    return rt


def test_every_emulator_rule_has_a_break_here() -> None:
    from eagle_export.tools.testing.trt_emulator import RULES

    assert sorted(BREAKS) == sorted(RULES)


@pytest.mark.parametrize("rule, i", [(r, i) for r, ways in BREAKS.items() for i in range(len(ways))])
def test_the_emulator_reports_each_rule_broken_on_purpose(ran, rule, i):
    """The hand-made call runs as given (the baseline); the same call with one rule broken fails with that rule."""
    c = _Call(ran)
    assert c.run(c.context()) is True and not c.logger.errors  # the baseline call is valid
    c.be.stream.synchronize()
    c = _Call(ran)
    with pytest.raises(RuleViolation) as info:
        BREAKS[rule][i](c)
    assert info.value.rule == rule, str(info.value)
    c.be.stream.synchronize()


def test_engines_built_for_another_default_tree_say_so_at_open(engines, tmp_path, caplog):
    """`tune` after `build` (here: the default tree set to another top_k) leaves engines without a tree engine for the
    new default: opening says which trees and that `build` fixes it; the tree still drafts, level by level, losslessly.
    The engines as built say nothing."""
    import shutil

    from eagle_export.manifest import load_manifest, set_tree_defaults
    from eagle_export.tools.testing.trt_emulator import emulated_backend

    art = shutil.copytree(engines("fp32"), tmp_path / "art")
    with caplog.at_level("WARNING", logger="eagle_export"):
        emulated_backend(art)
    assert "built for other default trees" not in caplog.text
    set_tree_defaults(art, TreeParams(top_k=2, depth=3, total_tokens=6))
    with caplog.at_level("WARNING", logger="eagle_export"):
        rt = emulated_runtime(art, guard=False)
    assert ("the engines were built for other default trees than the manifest's, or by an older build (top_k 2, depth "
            "3, total_tokens 6)" in caplog.text and f"run `eagle-export build {art}` again" in caplog.text)
    prompt = [5, 9, 11, 4]
    want = EagleRuntime.open(art, threads=1, guard=False, fused=False).generate(prompt_ids=prompt, max_new_tokens=12,
                                                                                stop_on_eos=False)
    assert rt.generate(prompt_ids=prompt, max_new_tokens=12, stop_on_eos=False).tokens == want.tokens
    assert load_manifest(art).tree_defaults.top_k == 2
