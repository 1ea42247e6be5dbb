"""The shipped trained fixture: within its size budget, in the published layouts, and its heads really draft.

A random head is accepted about once in a hundred drafts (tau ~1.0); the trained heads must be accepted
several tokens deep, and greedy EAGLE on them must still equal transformers' own greedy decoding.
"""

from __future__ import annotations

import json

import pytest
import torch
from reference import Comparison, GreedyReference
from safetensors.torch import load_file

from eagle_export.export.checkpoint.loaders import load_draft_head, load_target
from eagle_export.runtime import EagleRuntime
from eagle_export.tools.commands.bench import read_prompts
from eagle_export.tools.commands.demo import FIXTURE, HEADS, fixture_tree
from eagle_export.tree_params import TreeLimits

MAX_MIB = 30.0
NEW_TOKENS = 48


def test_fixture_fits_its_budget_in_fp16():
    files = [p for p in FIXTURE.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files) / 2**20
    assert total <= MAX_MIB, f"fixture is {total:.1f} MiB, over the {MAX_MIB} MiB budget"
    for part in ("target", *HEADS):
        (st,) = (FIXTURE / part).glob("*.safetensors")
        floats = {k: v.dtype for k, v in load_file(str(st)).items() if v.is_floating_point()}
        assert floats and set(floats.values()) == {torch.float16}, f"{part}: {set(floats.values())}"
    assert (FIXTURE / "CARD.md").is_file()


def test_heads_load_through_the_published_layout_loaders():
    target = load_target(FIXTURE / "target", progress=False)
    e1 = load_draft_head(FIXTURE / "eagle1", target)
    e3 = load_draft_head(FIXTURE / "eagle3", target)
    assert (e1.variant, e3.variant) == ("eagle1", "eagle3")
    assert e3.vocab_size < target.config.vocab_size and not e3.d2t_identity
    assert e3.feature_layers == [2, 8, 13]


@pytest.mark.parametrize("head", HEADS)
def test_tuned_trees_fit_the_default_limits(head):
    fixture_tree(head).validate(TreeLimits())


@pytest.fixture(scope="module")
def reference():
    return GreedyReference(FIXTURE / "target")


@pytest.mark.parametrize("head", HEADS)
def test_trained_head_is_accepted_deep_and_output_stays_lossless(trained, reference, head):
    art = trained(head)
    rt = EagleRuntime.open(art, threads=1, guard=False)  # every round drafts: tau is the head's
    cmp = Comparison()
    accepted, rounds = 0, 0
    for spec in read_prompts(FIXTURE / "prompts.jsonl")[:4]:
        ids = rt.encode(spec.text)
        res = rt.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, stop_on_eos=False)
        reference.compare(ids, res.tokens, reference.generate(ids, NEW_TOKENS), cmp, f"{head} {spec.source}")
        accepted += sum(res.stats.accept_lengths)
        rounds += res.stats.rounds
    assert not cmp.failures, cmp.failures
    tau = (accepted + rounds) / rounds
    # The card reports ~3+ on the whole prompt set; a broken head or a feature mix-up falls to ~1.
    assert tau >= 2.0, f"{head}: tau {tau:.2f} on 4 fixture prompts"


def test_tree_json_names_both_heads():
    trees = json.loads((FIXTURE / "tree.json").read_text())
    assert set(HEADS) <= set(trees)
