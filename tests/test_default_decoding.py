"""No draft as an artifact's default decoding: what `eagle-export tune` writes when no tree beats plain decoding by
--min-speedup (a `null` row for one sequence in the manifest's batch_trees), and what the API, `generate`, `bench` and
`serve` then do with a request given no tree (decode plainly, with no draft call at all) and with an explicit tree
(draft)."""

from __future__ import annotations

import json
import shutil

import pytest
from cli_run import ok as run_cli

from eagle_export.manifest import load_manifest, set_tree_defaults
from eagle_export.runtime import EagleRuntime
from eagle_export.tree_params import BatchTree, BatchTrees, TreeParams

PROMPT = [5, 9, 13, 2, 7]
NO_DRAFT = BatchTrees((BatchTree(1, None, 0.97),))


@pytest.fixture(scope="module")
def plain_default(models, tmp_path_factory):
    """The tiny model's artifact, copied, with no draft as its default."""
    _, _, art = models("mha")
    out = tmp_path_factory.mktemp("plain_default") / "art"
    shutil.copytree(art, out)
    set_tree_defaults(out, None, batch_trees=NO_DRAFT)
    return out


def test_the_manifest_says_no_draft(plain_default, models):
    m = load_manifest(plain_default)
    assert m.default_tree() is None and m.tree_defaults == TreeParams()
    assert load_manifest(models("mha")[2]).default_tree() == TreeParams()


def test_api_decodes_plainly_by_default_and_drafts_an_explicit_tree(plain_default):
    with EagleRuntime.open(plain_default, threads=1, guard=False) as rt:
        default = rt.generate(prompt_ids=PROMPT, max_new_tokens=20, stop_on_eos=False)
        plain = rt.generate(prompt_ids=PROMPT, max_new_tokens=20, stop_on_eos=False, use_draft=False)
        tree = rt.generate(prompt_ids=PROMPT, max_new_tokens=20, stop_on_eos=False, tree=TreeParams(2, 2, 4))
    assert default.tokens == plain.tokens == tree.tokens
    s = default.stats
    assert s.draft_forwards == 0 and s.spec_rounds == 0 and s.plain_rounds == s.rounds  # not even the prefill's
    assert tree.stats.spec_rounds == tree.stats.rounds and tree.stats.draft_forwards > 0


def test_generate_bench_and_serve_follow_it(plain_default, tmp_path):
    out = json.loads(run_cli("generate", plain_default, "--prompt-ids", "5,9,13", "--max-new-tokens", 8,
                             "--json").stdout)
    assert (out["mode"], out["tree"], out["default"], out["stats"]["drafted_tokens"]) == ("no-draft", None, True, 0)
    out = json.loads(run_cli("generate", plain_default, "--prompt-ids", "5,9,13", "--max-new-tokens", 8, "--top-k",
                             2, "--json").stdout)
    assert out["mode"] == "eagle" and out["tree"]["top_k"] == 2 and out["stats"]["spec_rounds"] > 0
    agg = json.loads(run_cli("bench", plain_default, "--max-new-tokens", 8, "--threads", 1, "--json").stdout)[
        "aggregate"]
    assert agg["tree"] is None and agg["default"] is True
    assert agg["mode_share"] == {"spec": 0.0, "plain": 1.0, "short_chain": 0.0}
    assert agg["lossless"]
    table = run_cli("bench", plain_default, "--max-new-tokens", 8, "--threads", 1).stdout
    assert "no draft (the artifact's default, from `eagle-export tune`)" in table

    from live_server import LiveServer

    from eagle_export.serve import ServeOptions

    with LiveServer(ServeOptions(str(plain_default), model_name="m", threads=1)) as srv, srv.client() as h:
        card = h.get("/v1/models").json()["data"][0]["eagle"]
        assert card["default_tree"] is None and card["tree_defaults"] == TreeParams().to_dict()
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
        r = h.post("/v1/completions", json=body).json()
        assert r["eagle"]["tree"] is None and r["eagle"]["speculation"]["plain_rounds"] > 0
        assert r["eagle"]["speculation"]["drafted_tokens"] == 0
        r = h.post("/v1/completions", json={**body, "eagle": {"top_k": 2, "threshold": 0.01}}).json()
        assert r["eagle"]["tree"] == {"top_k": 2, "depth": 3, "total_tokens": 12, "threshold": 0.01}
        spec = r["eagle"]["choices"][0]["speculation"]
        assert spec["spec_rounds"] > 0 and spec["drafted_tokens"] > 0
        assert r["eagle"]["speculation"]["spec_share"] == pytest.approx(
            spec["spec_rounds"] / (spec["spec_rounds"] + spec["plain_rounds"]))


def test_tune_writes_no_draft_when_nothing_pays_and_removes_it_when_a_tree_does(models, tmp_path):
    """A random head is almost never accepted: no tree of a small grid beats plain decoding, so tune says so and
    writes the null row; with --min-speedup 0.01 the same figures make the winner the default, and the row goes."""
    from eagle_export.tools.commands.tune import tune, write_winner

    _, _, src = models("mha")
    art = tmp_path / "art"
    shutil.copytree(src, art)
    kw = dict(top_k="1,2", depth="1", total_tokens="1,2", max_new_tokens=6, threads=1, refine=False, confirm=0,
              spin=None, thresholds="0.3")
    report = tune(art, **kw)
    assert report.no_draft and report.verdict().startswith("no draft: no tree beat plain decoding by 1.05x")
    assert report.verdict() in report.format()
    assert [r.tree.threshold for r in report.rows if r.stage == "thresh"] == [0.3]
    write_winner(art, report)
    m = load_manifest(art)
    assert m.default_tree() is None and m.tree_defaults == report.winner.tree
    assert m.batch_trees.to_list() == [{"active": 1, "tree": None, "speedup": round(report.winner.speedup, 3)}]
    r = run_cli("tune", art, "--top-k", 1, "--depth", 1, "--total-tokens", 1, "--max-new-tokens", 4, "--threads", 1,
                "--no-refine", "--confirm", 0, "--spin", "off", "--thresholds", "0", "--min-speedup", 0.01)
    assert "default decoding: no draft" not in r.stdout and "no draft:" not in r.stdout
    assert "measured on the built-in one-line prompts" in r.stdout and "--prompts FILE" in r.stdout
    m = load_manifest(art)
    assert m.batch_trees is None and m.default_tree() == TreeParams(1, 1, 1)
