"""Where generation ends inside a round: EOS among a round's accepted drafts, capacity mid-round, with greedy and
sampled decoding, through the API and `generate --samples`.

The bigram pair (tests/bigram.py) makes this exact: its head is always accepted (4 drafts and a bonus per round
with the default tree) and its output follows a fixed cycle with EOS (id 2) in it, so each start token puts the EOS
at a known place in a round. The output must end exactly at the first EOS with finish_reason "eos", and nothing after
it may be committed, streamed or reported.
"""

from __future__ import annotations

import json

import pytest
import torch
from cli_run import ok
from transformers import AutoModelForCausalLM

from eagle_export.runtime import EagleRuntime, SamplingParams

EOS = 2
SAMPLED = [SamplingParams(1.0, seed=s) for s in range(3)] + [SamplingParams(0.8, top_p=0.9, top_k=5, seed=7)]


def expected(cycle: list[int], start: int, n: int, stop_at_eos: bool = True) -> list[int]:
    """The n tokens after cycle[start] (up to the first EOS)."""
    out = [cycle[(start + 1 + i) % len(cycle)] for i in range(n)]
    return out[: out.index(EOS) + 1] if stop_at_eos and EOS in out else out


def run(rt, prompt, n, sampling=None, stop_on_eos=True):
    """Generate through the stream API; the chunks it yields, and the result."""
    stream = rt.stream(prompt_ids=prompt, max_new_tokens=n, sampling=sampling, stop_on_eos=stop_on_eos)
    chunks = [list(c) for c in stream]
    return chunks, stream.result


def eos_place(res) -> int | None:
    """Index of the EOS within the round that committed it (0 = its first token), None if the prefill did."""
    if not res.stats.rounds:
        return None
    before = 1 + sum(a + 1 for a in res.stats.accept_lengths[:-1])  # the prefill's token, then whole rounds
    return len(res.tokens) - 1 - before


@pytest.fixture(scope="module")
def eos_pair(bigram):
    target, art, cycle = bigram["eos"]
    assert EOS in cycle
    return target, EagleRuntime.open(art, threads=1), cycle


@pytest.mark.parametrize("sampling", [None, *SAMPLED], ids=["greedy"] + [f"sampled{i}" for i in range(len(SAMPLED))])
def test_eos_inside_an_accepted_round_ends_the_output_there(eos_pair, sampling):
    _, rt, cycle = eos_pair
    places = set()
    for start in range(len(cycle)):
        chunks, res = run(rt, [cycle[start]], 40, sampling)
        want = expected(cycle, start, 40)
        assert res.tokens == want, (start, res.tokens)
        assert res.finish_reason == "eos" and res.tokens.count(EOS) == 1 and res.tokens[-1] == EOS
        assert [t for c in chunks for t in c] == res.tokens  # nothing streamed after the EOS
        place = eos_place(res)
        places.add(place)
        if place is not None:
            assert res.stats.accept_lengths[-1] == 4  # the round accepted its whole path; the EOS cut it short
    # The EOS came from the prefill, from every place in a round (first draft ... bonus), so also mid-round.
    assert places == {None, 0, 1, 2, 3, 4}, places


def test_eos_output_equals_transformers_stopping_at_eos(eos_pair):
    target, rt, cycle = eos_pair
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for start in range(len(cycle)):
        with torch.no_grad():
            out = hf.generate(torch.tensor([[cycle[start]]]), max_new_tokens=40, do_sample=False, eos_token_id=EOS,
                              pad_token_id=0)[0, 1:].tolist()
        assert rt.generate(prompt_ids=[cycle[start]], max_new_tokens=40).tokens == out


def test_eos_at_the_length_limit(eos_pair):
    _, rt, cycle = eos_pair
    start = cycle.index(EOS) - 4  # the EOS is the 4th new token: mid-round (the prefill gives the 1st)
    _, res = run(rt, [cycle[start]], 4)
    assert res.tokens[-1] == EOS and len(res.tokens) == 4 and res.finish_reason == "eos"
    _, res = run(rt, [cycle[start]], 3)
    assert EOS not in res.tokens and len(res.tokens) == 3 and res.finish_reason == "length"
    _, res = run(rt, [cycle[start]], 12, stop_on_eos=False)  # --ignore-eos: straight through
    assert res.tokens == expected(cycle, start, 12, stop_at_eos=False) and res.finish_reason == "length"


@pytest.mark.parametrize("sampling", [None, SAMPLED[0]], ids=["greedy", "sampled"])
def test_capacity_reached_mid_round(bigram, sampling):
    _, art, cycle = bigram["text"]
    rt = EagleRuntime.open(art, threads=1)
    capacity = rt.manifest.max_seq_len
    for n in (100, 101, 102, 103, 104, 127):  # the room left is not a whole number of rounds for most
        prompt = [cycle[i % len(cycle)] for i in range(n)]
        chunks, res = run(rt, prompt, 64, sampling)
        assert res.finish_reason == "capacity" and len(res.tokens) == capacity - n, (n, res.finish_reason)
        assert res.tokens == expected(cycle, n - 1, capacity - n)
        assert [t for c in chunks for t in c] == res.tokens


def test_sampled_generation_reaches_capacity_on_a_random_model(models):
    """A random target and head (real rejections, not the bigram's sure acceptance), capacity 40."""
    rt = EagleRuntime.open(models("mha", max_seq_len=40)[2], threads=1)
    for seed, n in ((0, 30), (1, 35), (2, 39)):
        res = rt.generate(prompt_ids=[(7 * i + seed) % 48 for i in range(n)], max_new_tokens=20, stop_on_eos=False,
                          sampling=SamplingParams(1.0, seed=seed))
        assert res.finish_reason == "capacity" and len(res.tokens) == 40 - n


def test_samples_with_eos(bigram):
    _, art, cycle = bigram["eos"]
    args = ("generate", art, "--prompt-ids", cycle[0], "--max-new-tokens", 30, "--temperature", 1.0, "--seed", 5,
            "--samples", 4)
    out = json.loads(ok(*args, "--json").stdout)
    want = expected(cycle, 0, 30)
    assert [s["seed"] for s in out["samples"]] == [5, 6, 7, 8]
    for s in out["samples"]:
        assert s["finish_reason"] == "eos" and s["tokens"] == want, s
    ignored = json.loads(ok(*args, "--ignore-eos", "--json").stdout)
    for s in ignored["samples"]:
        assert s["finish_reason"] == "length" and s["tokens"] == expected(cycle, 0, 30, stop_at_eos=False)
    text = ok(*args)
    assert text.stdout.splitlines() == [json.dumps(out["samples"][0]["text"])] * 4
    assert text.stderr.startswith(f"[4 samples, {4 * len(want)} tokens")
