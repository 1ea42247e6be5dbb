"""The TensorRT backend end to end on the CPU: real TensorRT-RTX engines (built in CI), executed by the emulator
of ``tools/trt_emulator.py``, which enforces TensorRT's rules for every call and runs the engines' source ONNX
graphs with ONNX Runtime over exactly the memory the backend bound.

Full generations through ``TrtBackend``: greedy equal to transformers, sampling equal to ONNX Runtime with the
same seed, prompts longer than --max-prefill, a 1-token prompt, capacity reached, fp16, bf16, EAGLE-1/2 and
EAGLE-3 heads; planted rule violations fail with their rule's message.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from reference import Comparison, GreedyReference

from eagle_export import contract as C
from eagle_export.errors import EngineError
from eagle_export.runtime import EagleRuntime
from eagle_export.runtime.backend import Backend
from eagle_export.runtime.sampling import SamplingParams
from eagle_export.runtime.trt_backend import GraphBindings, TrtBackend
from eagle_export.tools.trt_emulator import RuleViolation, TrtEmulator, emulated_runtime
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
    # Both profiles of both engines ran, and prefill chunks never exceeded the prefill profile.
    emu = rt.backend.emulator
    used = {(g, p) for g, p, _ in emu.executions}
    assert used == {(C.TARGET_GRAPH, 0), (C.TARGET_GRAPH, 1), (C.DRAFT_GRAPH, 0), (C.DRAFT_GRAPH, 1)}
    assert max(a[C.NEW_TOKENS] for g, p, a in emu.executions if g == C.TARGET_GRAPH and p == 0) == 16


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


def test_a_misaligned_address_fails_with_the_alignment_rule(engines, monkeypatch):
    """Planted: the planner binds the logits 64 bytes into their buffer."""
    bind = GraphBindings._bind_output

    def shifted(self, name, d):
        b = bind(self, name, d)
        return b.__class__(b.name, b.shape, b.address + 64) if name == C.LOGITS else b

    monkeypatch.setattr(GraphBindings, "_bind_output", shifted)
    rt = emulated_runtime(engines("fp32"))
    with pytest.raises(RuleViolation, match=r"TensorRT rule broken \(alignment: tensor addresses are 256-byte "
                                            r"aligned\): target_verify: logits at 0x[0-9a-f]+ \(64 bytes past"):
        rt.generate(prompt_ids=[3, 4, 5], max_new_tokens=4, stop_on_eos=False)


def test_reading_outputs_before_the_stream_syncs_fails_with_the_sync_rule(engines, monkeypatch):
    """Planted: the backend no longer orders the caller's stream after its own (caller.wait_stream dropped)."""
    rt = emulated_runtime(engines("fp32"))
    mem = rt.backend.mem
    monkeypatch.setattr(type(mem.default), "wait_stream", lambda self, other: None)
    with pytest.raises(RuleViolation, match=r"TensorRT rule broken \(sync: .*\): a host read of .* while the "
                                            r"outputs of target_verify \(profile 0\)"):
        rt.generate(prompt_ids=[3, 4, 5], max_new_tokens=4, stop_on_eos=False)


def test_two_contexts_on_one_profile_fail_with_the_own_profile_rule(engines):
    art = engines("fp32")
    from eagle_export.manifest import load_manifest

    emu = TrtEmulator(art, load_manifest(art))
    be = emu.backend()
    ctx = be.graphs[C.TARGET_GRAPH].engine.create_execution_context()
    with pytest.raises(RuleViolation, match=r"own-profile.*profile 1 already belongs to another execution context"):
        ctx.set_optimization_profile_async(1, be.stream.cuda_stream)
