"""Reference greedy decoding with transformers, and the tie rule used when comparing against it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

TIE_GAP = 1e-4
# fp16 graphs against the fp32 reference: validate measures fp16 logits within ~0.1 of fp32 at worst on the tiny
# models (typically far less), and the fp16 loops diverge from transformers only where its top-2 gap was <= 0.011
# (test_fp16_loop.py prints each one). A first mismatch with a larger reference gap is a bug.
FP16_TIE_GAP = 0.05


@dataclass
class Comparison:
    tokens: int = 0  # tokens compared equal: a whole sequence, or the tokens before its first (tie) mismatch
    ties: int = 0
    failures: list[str] = field(default_factory=list)


class GreedyReference:
    """transformers' own greedy `generate` on the original checkpoint (fp32, eager attention)."""

    def __init__(self, target_dir):
        self.model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
        # No EOS anywhere: compare full-length runs (the model's own generation_config would stop early).
        self.model.generation_config.eos_token_id = None
        self.config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt])
        out = self.model.generate(ids, generation_config=self.config, max_new_tokens=max_new_tokens)
        return out[0, len(prompt):].tolist()

    @torch.no_grad()
    def top2_gap(self, prefix: list[int]) -> float:
        logits = self.model(torch.tensor([prefix])).logits[0, -1]
        top = torch.topk(logits, 2).values
        return float(top[0] - top[1])

    def compare(self, prompt: list[int], got: list[int], want: list[int], cmp: Comparison, label: str,
                tie_gap: float = TIE_GAP) -> None:
        """Token-for-token equality; a first mismatch counts as a tie only if the reference's top-2 gap < tie_gap.
        Tokens after a tie belong to another sequence: they are not counted as compared."""
        n = min(len(got), len(want))
        for i in range(n):
            if got[i] != want[i]:
                cmp.tokens += i
                gap = self.top2_gap(prompt + want[:i])
                if gap < tie_gap:
                    cmp.ties += 1
                else:
                    cmp.failures.append(f"{label}: prompt {prompt} differs at new token {i}: got {got[i]} "
                                        f"want {want[i]} (reference top-2 gap {gap:.3g})")
                return  # the sequences diverge after a tie; nothing further to compare
        cmp.tokens += n
        if len(got) != len(want):
            cmp.failures.append(f"{label}: prompt {prompt}: got {len(got)} tokens, want {len(want)}")
