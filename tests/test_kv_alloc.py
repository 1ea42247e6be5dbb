"""The KV buffers are allocated once per runtime, the decoding loop neither reallocates nor copies them, and the rows it
commits hold the right K/V (transformers' own cache for the target)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from eagle_export.runtime import EagleRuntime
from eagle_export.runtime.kv_cache import KVCache
from eagle_export.runtime.views import view_of
from eagle_export.tree_params import TreeParams


def cache_bytes(cache: KVCache) -> int:
    return sum(b.numel() * b.element_size() for b in cache.buffers)


def test_buffers_are_allocated_once_and_loop_allocates_nothing_cache_sized(models):
    _, _, art = models("gqa", max_seq_len=2048)
    rt = EagleRuntime.open(art, threads=1, guard=False)  # every round drafts
    gen = rt.generator
    buffers = [*gen.tcache.buffers, *gen.dcache.buffers, *gen.tcache.new_buffers, *gen.dcache.new_buffers]
    ptrs = [b.data_ptr() for b in buffers]
    smallest = min(b.numel() * b.element_size() for b in (*gen.tcache.buffers, *gen.dcache.buffers))
    prompt = list(range(3, 40))
    tree = TreeParams(top_k=4, depth=3, total_tokens=10)
    # Warm-up: the same generation, so the tree grower has met every verify-tree shape it will build (it keeps
    # one structure per shape, a bounded cache of small arrays).
    rt.generate(prompt_ids=prompt, max_new_tokens=64, tree=tree, stop_on_eos=False)

    # Torch allocations inside the loop (commit gathers, feature gathers, argmax): none may be cache-sized.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        tracemalloc.start()
        res = rt.generate(prompt_ids=prompt, max_new_tokens=64, tree=tree, stop_on_eos=False)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert res.stats.rounds > 10 and sum(res.stats.accept_lengths) > 0
    biggest_torch = max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)
    print(f"\ncache: {cache_bytes(gen.tcache) + cache_bytes(gen.dcache)} B in {len(buffers)} buffers; "
          f"loop: python/numpy peak {peak} B, largest torch allocation {biggest_torch} B")
    assert biggest_torch < smallest / 8, "a cache-sized torch allocation happened inside the loop"
    assert peak < smallest / 2, "a cache-sized numpy/python allocation happened inside the loop"
    # Same buffers, same addresses: the graphs wrote into them in place.
    assert [b.data_ptr() for b in buffers] == ptrs
    assert all(b is c for b, c in zip(buffers, [*gen.tcache.buffers, *gen.dcache.buffers, *gen.tcache.new_buffers,
                                                *gen.dcache.new_buffers], strict=True))


def poisoned_runtime(art) -> EagleRuntime:
    """A runtime whose K/V buffers (committed and new-rows scratch) hold NaN: a row nobody wrote cannot match."""
    rt = EagleRuntime.open(art, threads=1, guard=False)  # every round drafts
    g = rt.generator
    for b in (*g.tcache.buffers, *g.dcache.buffers, *g.tcache.new_buffers, *g.dcache.new_buffers):
        b.fill_(float("nan"))
    return rt


def test_loop_writes_kv_into_the_preallocated_buffers(models):
    """After generation the committed target rows hold exactly transformers' own K/V cache of the whole text, and the
    committed draft rows equal a fresh prefill's on a second runtime (every buffer of both NaN-poisoned first)."""
    target, _, art = models("gqa", max_seq_len=256)
    rt = poisoned_runtime(art)
    prompt = list(range(3, 20))
    res = rt.generate(prompt_ids=prompt, max_new_tokens=30, tree=TreeParams(4, 3, 10), stop_on_eos=False)
    assert sum(res.stats.accept_lengths) > 0  # multi-token commits are among the rows checked
    text = prompt + res.tokens[:-1]  # the last token is not fed yet
    committed = len(text)
    # Target: transformers' cache of the same text (keys after RoPE, as the graph's present_key).
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        cache = hf(torch.tensor([text]), use_cache=True).past_key_values
    bufs = rt.generator.tcache.buffers
    assert len(bufs) == 2 * len(cache.layers)
    for i, layer in enumerate(cache.layers):
        for got, want in ((bufs[2 * i], layer.keys), (bufs[2 * i + 1], layer.values)):
            np.testing.assert_allclose(got[0, :committed].numpy(), want[0].transpose(0, 1).numpy(), atol=1e-4)
    # Draft: the rows of every round but the last (the last round's context pass never runs: generation ended).
    drafted = len(prompt) + sum(a + 1 for a in res.stats.accept_lengths[:-1])
    fresh = poisoned_runtime(art)
    fresh.generate(prompt_ids=text, max_new_tokens=1, stop_on_eos=False)  # prefill + the draft's context pass
    for got, want in zip(rt.generator.dcache.buffers, fresh.generator.dcache.buffers, strict=True):
        assert not torch.isnan(want[0, :committed]).any()
        np.testing.assert_allclose(got[0, :drafted].numpy(), want[0, :drafted].numpy(), atol=1e-4)
    print(f"\n{committed} target rows equal transformers' cache, {drafted} draft rows a fresh prefill's")


def test_write_copies_new_rows_into_the_cache():
    cache = KVCache(num_layers=1, kv_heads=1, head_dim=2, capacity=16, dtype=torch.float32, new_rows=6)
    for i, b in enumerate(cache.new_buffers):
        b[0, :, 0, 0] = torch.arange(6, dtype=torch.float32) + 10 * i
    cache.write(4, 3)  # a prefill chunk or a draft call: every new row, in order
    for i, b in enumerate(cache.buffers):
        assert b[0, 4:7, 0, 0].tolist() == [10 * i, 10 * i + 1, 10 * i + 2]
        assert not b[0, :4].any() and not b[0, 7:].any()
    cache.write_rows(8, np.array([0, 2, 5]))  # a verify: the accepted path only
    for i, b in enumerate(cache.buffers):
        assert b[0, 8:11, 0, 0].tolist() == [10 * i, 10 * i + 2, 10 * i + 5]
        assert b[0, 4:7, 0, 0].tolist() == [10 * i, 10 * i + 1, 10 * i + 2] and not b[0, 11:].any()
    for bad in (lambda: cache.write(14, 3), lambda: cache.write(0, 7), lambda: cache.write_rows(0, np.array([6])),
                lambda: cache.write_rows(15, np.array([0, 1]))):
        with pytest.raises(IndexError):
            bad()
    # Graphs bind the scratch at row 0 (a fixed address) and the cache prefix by length.
    assert cache.new_views(4)[1] == view_of(cache.new_rows(4)[1])
    assert cache.views(0, 5)[0] == view_of(cache.rows(0, 5)[0])
