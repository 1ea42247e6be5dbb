"""validate's second and third checks: the runtime's greedy tokens (EAGLE and no-draft) against transformers'
``generate``, and EAGLE round by round against the PyTorch oracle; a mismatch at a near-tie is told apart by the
reference's top-2 logit gap."""

from __future__ import annotations

import time

import torch

from eagle_export.manifest import Manifest

from .report import TokenReport


def _hf_greedy(lm, prompt: list[int], n: int) -> list[int]:
    from transformers import GenerationConfig

    cfg = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=n)
    saved = lm.generation_config.eos_token_id
    lm.generation_config.eos_token_id = None  # else generate merges the model's own EOS back in and stops early
    try:
        with torch.no_grad():
            out = lm.generate(torch.tensor([prompt]), generation_config=cfg,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    finally:
        lm.generation_config.eos_token_id = saved
    return out[0, len(prompt):].tolist()


def _top2_gap(lm, prefix: list[int]) -> float:
    with torch.no_grad():
        row = lm(torch.tensor([prefix])).logits[0, -1]
    top = torch.topk(row, 2).values
    return float(top[0] - top[1])


def end_to_end(rt, oracle, lm, m: Manifest, prompts: list[list[int]], max_new: int, tie_gap: float, log=None):
    """log: called once per prompt, as it starts (the three generations of a prompt take a while on a big model)."""
    from eagle_export.runtime.oracle import EagleRound, compare_with_oracle

    greedy, eagle = TokenReport("greedy"), TokenReport("eagle")
    tree = m.tree_defaults
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        if log is not None:
            log(f"prompt {i + 1}/{len(prompts)} ({len(p)} tokens; {time.perf_counter() - t0:.0f} s so far)")
        room = m.max_seq_len - len(p)
        want = _hf_greedy(lm, p, min(max_new, room))
        rounds: list[EagleRound] = []
        res = rt.generate(prompt_ids=p, max_new_tokens=max_new, tree=tree, stop_on_eos=False,
                          on_round=lambda vt, acc, rounds=rounds: rounds.append(EagleRound.from_runtime(vt, acc)))
        plain = rt.generate(prompt_ids=p, max_new_tokens=max_new, use_draft=False, stop_on_eos=False)
        greedy.prompts += 1
        for label, got in (("eagle", res.tokens), ("no-draft", plain.tokens)):
            diff = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
            greedy.tokens += len(got) if diff is None else diff  # tokens after a divergence are not compared
            if diff is None and len(got) != len(want):
                greedy.failures.append(f"{label}, prompt {p}: {len(got)} tokens, transformers {len(want)}")
            elif diff is not None:
                gap = _top2_gap(lm, p + want[:diff])
                if gap < tie_gap:
                    greedy.ties += 1
                else:
                    greedy.failures.append(f"{label}, prompt {p}: token {diff} is {got[diff]}, transformers "
                                           f"{want[diff]} (top-2 gap {gap:.3g})")
        orc = oracle.generate(p, max_new, tree, capacity=m.max_seq_len)
        cmp = compare_with_oracle(res.tokens, rounds, orc, tie_gap)
        eagle.prompts += 1
        eagle.tokens += len(res.tokens)
        eagle.rounds += cmp.rounds_compared
        eagle.accepted += sum(r.accepted for r in rounds[: cmp.rounds_compared])
        if cmp.status == "tie":
            eagle.ties += 1
        elif cmp.status == "mismatch":
            eagle.failures.append(f"prompt {p}: {cmp.detail}")
    return greedy, eagle
