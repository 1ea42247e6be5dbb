"""Prompts longer than the prefill chunk: the chunked prefill (target K/V and the draft's context pass, chunk by
chunk) gives transformers' greedy tokens, EAGLE and --no-draft.

The default chunk (256) with prompts of 257 and 600 tokens on a capacity-2048 GQA model; a 16-token chunk on
the capacity-256 MHA model with prompts at and around chunk boundaries (16, 17, 32, 33, 100, 200 tokens), so every
later chunk attends to several cached ones and the draft context spans chunks. Ties: none allowed (fp32). Token
equality cannot see a wrong draft context (output stays lossless, only acceptance drops), so the EAGLE runs are
also compared round by round with the PyTorch oracle, which prefills in one pass: same trees, same accepted lengths
(prompts up to 260 tokens: the 257-token one spans two default chunks).
"""

from __future__ import annotations

import numpy as np
import pytest
from reference import Comparison, GreedyReference

from eagle_export.runtime import EagleRuntime
from eagle_export.runtime.oracle import EagleOracle, EagleRound, compare_with_oracle
from eagle_export.tree_params import TreeParams

NEW = 32
TREE = TreeParams(top_k=4, depth=3, total_tokens=10)
ORACLE_MAX = 260  # the oracle recomputes the whole sequence per call: longer prompts only against transformers
CASES = [
    pytest.param(("gqa", {"max_seq_len": 2048}), 256, (257, 600), id="chunk256-capacity2048"),
    pytest.param(("mha", {}), 16, (16, 17, 32, 33, 100, 200), id="chunk16-capacity256"),
]


@pytest.mark.parametrize("model, chunk, lengths", CASES)
def test_chunked_prefill_equals_transformers(models, model, chunk, lengths):
    preset, kw = model
    target, draft, art = models(preset, **kw)
    rt = EagleRuntime.open(art, threads=1, prefill_chunk=chunk)
    oracle = EagleOracle.load(target, draft)
    rounds_compared = 0
    assert rt.generator.chunk == chunk
    ref = GreedyReference(target)
    cmp = Comparison()
    rng = np.random.default_rng(chunk)
    accepted = 0
    for n in lengths:
        prompt = rng.integers(3, rt.manifest.target.vocab_size, n).tolist()
        want = ref.generate(prompt, NEW)
        for use_draft in (True, False):
            rounds: list[EagleRound] = []
            res = rt.generate(prompt_ids=prompt, max_new_tokens=NEW, tree=TREE, use_draft=use_draft,
                              stop_on_eos=False,
                              on_round=lambda vt, acc, rounds=rounds: rounds.append(EagleRound.from_runtime(vt, acc)))
            assert res.prompt_len == n and res.finish_reason == "length"
            if use_draft and n <= ORACLE_MAX:
                orc = compare_with_oracle(res.tokens, rounds, oracle.generate(prompt, NEW, TREE), 1e-4)
                assert orc.status == "match", f"{n}-token prompt: {orc.detail}"
                rounds_compared += orc.rounds_compared
            ref.compare(prompt, res.tokens, want, cmp, f"{n}-token prompt, {'eagle' if use_draft else 'no-draft'}")
            accepted += sum(res.stats.accept_lengths)
    print(f"\nchunk {chunk}, prompts {lengths}: {cmp.tokens} tokens compared, {cmp.ties} ties, {accepted} drafts "
          f"accepted, {rounds_compared} rounds equal to the oracle's")
    assert not cmp.failures, "\n".join(cmp.failures)
    assert cmp.ties == 0 and cmp.tokens == 2 * len(lengths) * NEW
    assert accepted > 0  # the draft context built chunk by chunk is used
