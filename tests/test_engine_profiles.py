"""Optimisation profiles from the manifest's axes (engines/profiles.py): exact ranges, the total_len = past_len +
new_tokens invariant at min/opt/max, option checks, and the per-call profile choice. No TensorRT needed."""

from __future__ import annotations

import pytest

from eagle_export import contract as C
from eagle_export.engines.profiles import (
    Profile,
    ProfileOptions,
    choose_profile,
    graph_profiles,
    resolve_options,
    tree_engine_calls,
    tree_profiles,
)
from eagle_export.errors import EngineError
from eagle_export.manifest import load_manifest


@pytest.fixture(scope="module")
def manifest(engines):
    # max_seq_len 64, limits top_k 4 / depth 3 / total 12, default tree 4/3/12, mha 2 layers, 4 kv heads x 16.
    return load_manifest(engines.artifact("fp32"))


def axes_of(p: Profile) -> dict:
    return {a: list(v) for a, v in p.axes.items()}


def test_default_options(manifest):
    o = resolve_options(manifest)
    assert (o.max_batch, o.max_prefill, o.max_tree_tokens) == (1, 64, 13)  # min(256, S), max_total_tokens + 1


def test_target_profiles_exact(manifest):
    pre, ver = graph_profiles(manifest, C.TARGET_GRAPH, resolve_options(manifest))
    assert pre.name == "prefill" and ver.name == "verify"
    assert axes_of(pre) == {"batch": [1, 1, 1], "new_tokens": [1, 64, 64], "past_len": [0, 0, 63],
                            "logit_rows": [1, 1, 1], "total_len": [1, 64, 127]}
    assert axes_of(ver) == {"batch": [1, 1, 1], "new_tokens": [1, 13, 13], "past_len": [1, 31, 63],
                            "logit_rows": [1, 13, 13], "total_len": [2, 44, 76]}
    assert pre.shapes[C.ATTENTION_MASK] == ((1, 1, 1), (1, 64, 64), (1, 64, 127))
    assert pre.shapes[C.LOGIT_INDICES] == ((1, 1), (1, 1), (1, 1))
    assert ver.shapes[C.LOGIT_INDICES] == ((1, 1), (1, 13), (1, 13))
    assert ver.shapes["past_key.1"] == ((1, 1, 4, 16), (1, 31, 4, 16), (1, 63, 4, 16))
    assert set(pre.shapes) == set(manifest.graphs[C.TARGET_GRAPH].spec.input_names)


def test_draft_profiles_exact(manifest):
    pre, dec = graph_profiles(manifest, C.DRAFT_GRAPH, resolve_options(manifest))
    assert pre.name == "context" and dec.name == "tree"
    # past_len max is the manifest's S + max_depth * max_top_k = 64 + 12; tree levels take up to K = 4 rows.
    # Context rows come from features only, tree rows from hidden_in only: the row axes sum to new_tokens.
    assert axes_of(pre) == {"batch": [1, 1, 1], "new_tokens": [1, 64, 64], "feature_rows": [1, 64, 64],
                            "hidden_rows": [0, 0, 0], "past_len": [0, 0, 76], "total_len": [1, 64, 140]}
    assert axes_of(dec) == {"batch": [1, 1, 1], "new_tokens": [1, 4, 4], "feature_rows": [0, 0, 0],
                            "hidden_rows": [1, 4, 4], "past_len": [1, 31, 76], "total_len": [2, 35, 80]}
    assert dec.shapes[C.HIDDEN_IN] == ((1, 1, 64), (1, 4, 64), (1, 4, 64))
    assert dec.shapes[C.DRAFT_FEATURES] == ((1, 0, 64), (1, 0, 64), (1, 0, 64))
    small = graph_profiles(manifest, C.DRAFT_GRAPH, resolve_options(manifest, ProfileOptions(max_prefill=2)))[0]
    assert small.axes["new_tokens"] == (1, 2, 5)  # the context after a round: up to max_depth + 2 rows
    assert set(dec.shapes) == set(manifest.graphs[C.DRAFT_GRAPH].spec.input_names)


@pytest.mark.parametrize("opts", [ProfileOptions(), ProfileOptions(max_prefill=1), ProfileOptions(max_prefill=17),
                                  ProfileOptions(max_tree_tokens=2), ProfileOptions(max_tree_tokens=7)])
@pytest.mark.parametrize("graph", [C.TARGET_GRAPH, C.DRAFT_GRAPH])
def test_every_point_is_consistent(manifest, opts, graph):
    """At min, opt and max: mask width = past + new, shared axes agree, every value inside the manifest's range."""
    entry = manifest.graphs[graph]
    for p in graph_profiles(manifest, graph, resolve_options(manifest, opts)):
        for i in range(3):
            s = {n: v[i] for n, v in p.shapes.items()}
            b, new, total = s[C.ATTENTION_MASK]
            past = s["past_key.0"][1]
            assert total == past + new
            assert s[C.POSITION_IDS] == (b, new)
            if graph == C.TARGET_GRAPH:
                assert s[C.INPUT_IDS] == (b, new)
            else:
                assert s[C.INPUT_EMBEDS] == (b, new, manifest.draft.hidden_size)
                assert s[C.DRAFT_FEATURES][1] + s[C.HIDDEN_IN][1] == new
            for a, v in p.axes.items():
                lo, hi = entry.axes[a]
                assert lo <= v[i] <= hi, (p.name, a, v)
        for v in p.axes.values():
            assert v[0] <= v[1] <= v[2]


def test_custom_options(manifest):
    o = resolve_options(manifest, ProfileOptions(max_prefill=16, max_tree_tokens=8))
    pre, ver = graph_profiles(manifest, C.TARGET_GRAPH, o)
    assert pre.axes[C.NEW_TOKENS] == (1, 16, 16)
    assert ver.axes[C.NEW_TOKENS] == ver.axes[C.LOGIT_ROWS] == (1, 8, 8)  # default tree (13) clamped to 8
    dpre, _ = graph_profiles(manifest, C.DRAFT_GRAPH, o)
    assert dpre.axes[C.NEW_TOKENS] == (1, 16, 16)


@pytest.mark.parametrize("opts, flag, rng", [
    (ProfileOptions(max_batch=2), "--max-batch", "[1, 1]"),
    (ProfileOptions(max_batch=0), "--max-batch", "[1, 1]"),
    (ProfileOptions(max_prefill=0), "--max-prefill", "[1, 64]"),
    (ProfileOptions(max_prefill=65), "--max-prefill", "[1, 64]"),
    (ProfileOptions(max_tree_tokens=1), "--max-tree-tokens", "[2, 13]"),
    (ProfileOptions(max_tree_tokens=14), "--max-tree-tokens", "[2, 13]"),
])
def test_bad_options(manifest, opts, flag, rng):
    with pytest.raises(EngineError) as info:
        resolve_options(manifest, opts)
    assert flag in str(info.value) and rng in str(info.value)


@pytest.mark.parametrize("call, expect", [
    (dict(batch=1, new_tokens=10, past_len=0, logit_rows=1), 0),     # first prefill chunk
    (dict(batch=1, new_tokens=64, past_len=0, logit_rows=1), 0),     # a full chunk
    (dict(batch=1, new_tokens=20, past_len=30, logit_rows=1), 0),    # later chunk, longer than any verify
    (dict(batch=1, new_tokens=13, past_len=20, logit_rows=13), 1),   # verify
    (dict(batch=1, new_tokens=1, past_len=20, logit_rows=1), 1),     # plain decode: the smaller profile
    (dict(batch=1, new_tokens=1, past_len=0, logit_rows=1), 0),      # a one-token prompt: verify starts at past 1
    (dict(batch=1, new_tokens=14, past_len=20, logit_rows=14), None),  # above --max-tree-tokens
    (dict(batch=2, new_tokens=4, past_len=20, logit_rows=1), None),  # batch above --max-batch
])
def test_choose_target_profile(manifest, call, expect):
    profiles = graph_profiles(manifest, C.TARGET_GRAPH, resolve_options(manifest))
    call = {**call, C.TOTAL_LEN: call["past_len"] + call["new_tokens"]}
    assert choose_profile(profiles, call) == expect


def test_choose_draft_profile(manifest):
    profiles = graph_profiles(manifest, C.DRAFT_GRAPH, resolve_options(manifest))

    def pick(new, past):
        return choose_profile(profiles, {"batch": 1, "new_tokens": new, "past_len": past, "total_len": new + past})

    assert pick(40, 0) == 0  # prompt context
    assert pick(4, 20) == 1  # a tree level (top_k rows) or the context pass after a round (<= depth + 1 rows)
    assert pick(4, 0) == 0  # a 4-token prompt
    assert pick(5, 20) == 0  # only the prefill profile is wide enough
    assert pick(65, 0) is None


def test_profile_round_trip(manifest):
    for g in (C.TARGET_GRAPH, C.DRAFT_GRAPH):
        for p in graph_profiles(manifest, g, resolve_options(manifest)):
            assert Profile.from_dict(p.to_dict()) == p


def test_max_batch_profiles(manifest):
    """An artifact exported with --max-batch 4: batch min 1 everywhere, opt 4 (a full batch) in the per-round
    profiles (verify, tree levels), opt 1 in the per-request ones (prefill, context), max = --max-batch."""
    import copy

    m = copy.deepcopy(manifest)
    for g in m.graphs.values():
        g.axes[C.BATCH] = [1, 4]
    assert m.max_batch == 4
    for flag, want in ((None, 4), (3, 3)):
        o = resolve_options(m, ProfileOptions(max_batch=flag))  # None: the artifact's range
        assert o.max_batch == (flag or 4)
        pre, ver = graph_profiles(m, C.TARGET_GRAPH, o)
        ctx, tree = graph_profiles(m, C.DRAFT_GRAPH, o)
        assert pre.axes[C.BATCH] == ctx.axes[C.BATCH] == (1, 1, want)
        assert ver.axes[C.BATCH] == tree.axes[C.BATCH] == (1, want, want)
        assert ver.shapes["past_key.0"][1][0] == want and ver.shapes[C.ATTENTION_MASK][2][0] == want
    with pytest.raises(EngineError, match=r"--max-batch must be an integer in \[1, 4\]"):
        resolve_options(m, ProfileOptions(max_batch=5))


def test_tree_engine_calls_follow_the_default_trees(manifest):
    """One tree engine per top_k among the default trees, at the deepest depth they use: the default tree's alone,
    then with a per-batch table (a deeper tree of the same top_k, a chain, a row without a draft). A depth the tree's
    total_tokens never reach is not built: the chain 1/3/3 drafts 2 levels (TreeParams.trimmed)."""
    from dataclasses import replace

    from eagle_export.tree_params import BatchTree, BatchTrees, TreeParams

    assert tree_engine_calls(manifest) == [(4, 3)]
    table = BatchTrees((BatchTree(1, TreeParams(4, 2, 8)), BatchTree(2, TreeParams(4, 3, 12)),
                        BatchTree(3, TreeParams(1, 3, 3)), BatchTree(4, None)))
    m = replace(manifest, tree_defaults=TreeParams(4, 2, 8), batch_trees=table)
    assert tree_engine_calls(m) == [(1, 2), (4, 3)]
    # An artifact exported without tree graphs (`export --no-draft-tree`) builds none.
    bare = replace(manifest, graphs={n: g for n, g in manifest.graphs.items() if not C.is_tree_graph(n)})
    assert tree_engine_calls(bare) == []


def test_tree_profiles_exact(manifest):
    """A prompt chunk's context pass (batch 1 opt, from an empty cache) and a round's (the accepted rows and the
    bonus, up to max_depth + 2, after at least one committed row); the mask is past + new at every point."""
    pre, rnd = tree_profiles(manifest, 4, 3, resolve_options(manifest))
    assert (pre.name, rnd.name) == ("prefill", "round")
    assert axes_of(pre) == {"batch": [1, 1, 1], "new_tokens": [1, 64, 64], "past_len": [0, 0, 76],
                            "total_len": [1, 64, 140]}
    assert axes_of(rnd) == {"batch": [1, 1, 1], "new_tokens": [1, 4, 5], "past_len": [1, 31, 76],
                            "total_len": [2, 35, 81]}
    assert set(pre.shapes) == set(manifest.graphs[C.tree_graph(4)].spec.input_names)
    assert rnd.shapes[C.LAST_ROW] == ((1,), (1,), (1,))
    for p in (pre, rnd):
        for i in range(3):
            mask, pos = p.shapes[C.ATTENTION_MASK][i], p.shapes["past_key.0"][i]
            assert mask[2] == pos[1] + mask[1]
    # The round profile is chosen for a round's context pass, the prefill profile for a chunk or a long catch-up.
    assert choose_profile([pre, rnd], {"batch": 1, "new_tokens": 4, "past_len": 30}) == 1
    assert choose_profile([pre, rnd], {"batch": 1, "new_tokens": 9, "past_len": 30}) == 0
    assert choose_profile([pre, rnd], {"batch": 1, "new_tokens": 4, "past_len": 0}) == 0
