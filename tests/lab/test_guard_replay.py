"""tools/lab/guard_replay: the replay drives the runtime's Guard as the generator does, over recorded acceptance."""

from __future__ import annotations

import json

from click.testing import CliRunner
from guard_replay import main, replay_one

from eagle_export.runtime.guard import GuardPolicy, RoundCosts

TREE = (("depth", 3), ("top_k", 1), ("total_tokens", 3))


def test_a_draft_that_always_pays_is_always_drafting():
    """Every round accepts its whole chain (commits 4): 40 tokens after the prefill's take 10 rounds of 2 steps."""
    acc = [0] + [3] * 40
    assert replay_one(GuardPolicy(), True, acc, 3, 2.0, 1.0, RoundCosts(), TREE) == 20.0


def test_a_dead_draft_costs_little_more_than_plain_decoding():
    """Nothing accepted, rounds of 3 steps: the guard leaves after its first rounds and reads now and then; always
    drafting would take 3 steps a token. 199 tokens: within 10% of plain decoding's 199 steps."""
    acc = [0] * 200
    steps = replay_one(GuardPolicy(), True, acc, 3, 3.0, 1.0, RoundCosts(), TREE)
    assert 199 < steps < 1.1 * 199


def test_reads_are_charged_and_spaced_by_their_cost():
    """A dead draft read every 8/16/32... tokens costs more with dear reads; spaced by their cost (floor on), the
    same dear reads cost less than unspaced."""
    acc = [0] * 400
    cheap = replay_one(GuardPolicy(), False, acc, 3, 3.0, 0.1, RoundCosts(), TREE)
    dear = replay_one(GuardPolicy(), False, acc, 3, 3.0, 3.0, RoundCosts(), TREE)
    spaced = replay_one(GuardPolicy(), True, acc, 3, 3.0, 3.0, RoundCosts(), TREE)
    assert cheap < spaced < dear


def test_replay_prints_every_policy(tmp_path):
    rec = tmp_path / "rec.json"
    rec.write_text(json.dumps({"artifact": "x", "tree": {"top_k": 1, "depth": 3, "total_tokens": 3},
                               "prompts": [{"prompt": "a", "accepted": [0] + [3] * 30 + [0] * 60 + [3] * 30}]}))
    out = CliRunner().invoke(main, ["replay", str(rec), "--ratio", "2,3"])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert sum(ln.startswith("  always drafting") for ln in lines) == 2
    assert sum(ln.startswith("  default (all three)") for ln in lines) == 2


def test_the_guard_reads_its_figure_and_pays_the_true_cost():
    """Rounds committing 2 at a true cost of 1.5 steps pay (30 rounds, 45 steps); a guard that reads a ratio of 4
    (speculation at 0.5x) leaves after its first rounds and decodes plainly, paying more than the true 45 steps and
    about plain decoding's 60 (planted: the read figure charged as the cost, 71 steps, fails)."""
    acc = [0] + [1] * 60
    assert replay_one(GuardPolicy(), True, acc, 3, 1.5, 1.0, RoundCosts(), TREE) == 45.0
    misread = replay_one(GuardPolicy(), True, acc, 3, 1.5, 1.0, RoundCosts(), TREE, seen=4.0)
    assert 45.0 < misread < 1.15 * 60
