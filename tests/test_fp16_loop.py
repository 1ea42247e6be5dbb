"""fp16 artifacts through the whole EAGLE loop against transformers' greedy generate on the fp32 checkpoint.

Per head kind (EAGLE-1/2 on a Llama MHA target, EAGLE-3 with a 32-token draft vocabulary on a GQA target): 8
prompts x 48 new tokens, EAGLE and --no-draft, on ONNX Runtime CPU. A first mismatch is a tie only where the
reference's top-2 logit gap is below FP16_TIE_GAP (each one printed with its gap); a larger gap fails. Ties are
bounded and most tokens must be compared before any divergence.
"""

from __future__ import annotations

import numpy as np
import pytest
from reference import FP16_TIE_GAP, Comparison, GreedyReference

from eagle_export.runtime import EagleRuntime

NEW = 48
PROMPTS = 8
HEADS = [
    pytest.param("mha", {}, id="eagle1-mha"),
    pytest.param("gqa", {"eagle3": True, "draft_vocab": 32}, id="eagle3-gqa-d2t"),
]


@pytest.mark.parametrize("preset, kw", HEADS)
def test_fp16_loop_equals_transformers_up_to_fp16_ties(models, preset, kw):
    target, _, art = models(preset, dtype="fp16", **kw)
    rt = EagleRuntime.open(art, threads=1, guard=False)  # every round drafts
    assert rt.manifest.dtype == "float16"
    ref = GreedyReference(target)
    cmp = Comparison()
    accepted = 0
    rng = np.random.default_rng(0)
    for _ in range(PROMPTS):
        prompt = rng.integers(3, 48, int(rng.integers(4, 40))).tolist()
        want = ref.generate(prompt, NEW)
        for use_draft in (True, False):
            res = rt.generate(prompt_ids=prompt, max_new_tokens=NEW, use_draft=use_draft, stop_on_eos=False)
            assert res.finish_reason == "length" and len(res.tokens) == NEW
            ties = cmp.ties
            ref.compare(prompt, res.tokens, want, cmp, "eagle" if use_draft else "no-draft", tie_gap=FP16_TIE_GAP)
            if cmp.ties > ties:
                i = next(j for j, (a, b) in enumerate(zip(res.tokens, want, strict=True)) if a != b)
                print(f"\n  tie: {'eagle' if use_draft else 'no-draft'} token {i}, reference top-2 gap "
                      f"{ref.top2_gap(prompt + want[:i]):.4f}", end="")
            accepted += sum(res.stats.accept_lengths)
    total = 2 * PROMPTS * NEW
    print(f"\n{preset} {kw} fp16: {cmp.tokens} of {total} tokens compared, {cmp.ties} ties (top-2 gap < "
          f"{FP16_TIE_GAP}), {accepted} draft tokens accepted")
    assert not cmp.failures, "\n".join(cmp.failures[:5])
    assert cmp.ties <= 6, cmp  # of 16 sequences; measured: 0 (EAGLE-1/2) and 6 (3 prompts, both modes: EAGLE-3)
    assert cmp.tokens >= 0.8 * total, cmp
    assert accepted >= 20, "the loop's multi-token commits were barely exercised"
