"""The `eagle-export` console entry: export, generate (--json and streaming), finish reasons, and
every bad request answered with one clear line and exit status 2 (never a traceback)."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import cli, fail, ok

from eagle_export.manifest import load_manifest

P12 = [(7 * i + 3) % 48 for i in range(12)]  # ids valid in the 48-token fixtures
P30 = [(5 * i + 4) % 48 for i in range(30)]


def ids(xs) -> str:
    return ",".join(map(str, xs))


def gen(artifact, *args) -> dict:
    r = ok("generate", artifact, "--json", *args)
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def plain(models) -> Path:
    """48-token model without tokenizer, capacity 256."""
    return models("mha")[2]


@pytest.fixture(scope="module")
def small(models) -> Path:
    """Same model (same seed), exported with capacity 40."""
    return models("mha", max_seq_len=40)[2]


# ---- generate: output ------------------------------------------------------------------------


def test_generate_json(tiny):
    # A prompt on which the random head gets some draft tokens accepted, so tau is not trivially 1.
    out = gen(tiny[2], "--prompt-ids", ids(P12), "--max-new-tokens", 24, "--ignore-eos", "--no-guard")
    assert {"tokens", "text", "finish_reason", "stats", "prompt_tokens", "mode", "tree", "default", "guard"} <= set(out)
    assert out["default"] is True and out["guard"] is False
    assert out["finish_reason"] == "length"
    assert len(out["tokens"]) == 24
    assert out["prompt_tokens"] == 12
    assert isinstance(out["text"], str)
    assert out["mode"] == "eagle" and out["tree"] == {"top_k": 4, "depth": 3, "total_tokens": 12}
    s = out["stats"]
    rounds, acc = s["rounds"], s["accept_lengths"]
    assert rounds >= 1 and len(acc) == rounds
    assert s["tau"] == pytest.approx((sum(acc) + rounds) / rounds)
    assert sum(acc) > 0 and s["tau"] > 1.0
    # The prefill gives one token, each round its accepted tokens plus one (the last round may be cut).
    assert len(out["tokens"]) <= 1 + sum(acc) + rounds
    # The speculation metrics: every round drafted a 12-node tree
    assert (s["spec_rounds"], s["plain_rounds"], s["spec_share"]) == (rounds, 0, 1.0)
    assert s["drafted_tokens"] == 12 * rounds and s["verified_tokens"] == 13 * rounds
    assert s["accepted_tokens"] == sum(acc) and s["acceptance_rate"] == pytest.approx(sum(acc) / (12 * rounds))
    assert s["draft_s"] > 0 and s["target_s"] > 0 and s["host_s"] >= 0 and s["guard_switches"] == 0


def test_prompt_text_equals_prompt_ids(tiny):
    from transformers import AutoTokenizer

    art = tiny[2]
    tok = AutoTokenizer.from_pretrained(str(art))
    text = "The quick brown fox"
    pids = tok(text)["input_ids"]
    a = gen(art, "--prompt", text, "--max-new-tokens", 10, "--ignore-eos")
    b = gen(art, "--prompt-ids", ids(pids), "--max-new-tokens", 10, "--ignore-eos")
    assert a["tokens"] == b["tokens"] and len(a["tokens"]) == 10
    assert a["prompt_tokens"] == len(pids)
    assert a["text"] == tok.decode(a["tokens"], skip_special_tokens=True)
    # Streaming mode prints the same text on stdout and a summary on stderr.
    r = ok("generate", art, "--prompt", text, "--max-new-tokens", 10, "--ignore-eos")
    assert r.stdout == a["text"] + "\n"
    assert "[10 tokens, finish=length" in r.stderr and "opened in " in r.stderr


def test_streaming_ids_without_tokenizer(plain):
    out = gen(plain, "--prompt-ids", ids(P12), "--max-new-tokens", 15, "--ignore-eos")
    assert out["text"] is None
    r = ok("generate", plain, "--prompt-ids", ids(P12), "--max-new-tokens", 15, "--ignore-eos")
    assert [int(x) for x in r.stdout.split()] == out["tokens"]
    assert "[15 tokens, finish=length" in r.stderr


@pytest.mark.parametrize("fixture", ["plain", "tiny"])
def test_no_draft_gives_same_tokens(request, fixture):
    art = request.getfixturevalue(fixture)
    art = art[2] if isinstance(art, tuple) else art
    prompt = P12 if fixture == "plain" else [1, 60, 61, 62, 100, 7]
    a = gen(art, "--prompt-ids", ids(prompt), "--max-new-tokens", 30, "--ignore-eos")
    b = gen(art, "--prompt-ids", ids(prompt), "--max-new-tokens", 30, "--ignore-eos", "--no-draft")
    assert a["tokens"] == b["tokens"] and len(a["tokens"]) == 30
    assert b["mode"] == "no-draft" and b["tree"] is None
    assert b["stats"]["rounds"] == 29 and b["stats"]["accept_lengths"] == [0] * 29 and b["stats"]["tau"] == 1.0


# ---- finish reasons --------------------------------------------------------------------------


@pytest.mark.parametrize("no_draft", [False, True])
def test_finish_eos(plain, tmp_path, no_draft):
    base = gen(plain, "--prompt-ids", ids(P12), "--max-new-tokens", 16, "--ignore-eos", "--no-draft")["tokens"]
    # The token of step 3, or the first later one not produced before it (so the stop is unambiguous).
    i = next(i for i in range(2, len(base)) if base[i] not in base[:i])
    eos = base[i]
    art = shutil.copytree(plain, tmp_path / "art")
    m = json.loads((art / "manifest.json").read_text())
    m["target"]["eos_token_ids"] = [eos]
    (art / "manifest.json").write_text(json.dumps(m))
    extra = ["--no-draft"] if no_draft else []
    out = gen(art, "--prompt-ids", ids(P12), "--max-new-tokens", 16, *extra)
    assert out["finish_reason"] == "eos"
    assert out["tokens"] == base[: i + 1] and out["tokens"][-1] == eos
    # --ignore-eos on the same artifact runs on to the length limit.
    out = gen(art, "--prompt-ids", ids(P12), "--max-new-tokens", 16, "--ignore-eos", *extra)
    assert out["finish_reason"] == "length" and out["tokens"] == base


@pytest.mark.parametrize("no_draft", [False, True])
def test_finish_capacity(plain, small, no_draft):
    assert load_manifest(small).max_seq_len == 40
    extra = ["--no-draft"] if no_draft else []
    out = gen(small, "--prompt-ids", ids(P30), "--max-new-tokens", 64, "--ignore-eos", *extra)
    assert out["finish_reason"] == "capacity"
    assert len(out["tokens"]) == 10
    big = gen(plain, "--prompt-ids", ids(P30), "--max-new-tokens", 10, "--ignore-eos", "--no-draft")
    assert big["finish_reason"] == "length" and out["tokens"] == big["tokens"]
    same = gen(small, "--prompt-ids", ids(P30), "--max-new-tokens", 10, "--ignore-eos", "--no-draft")
    assert same["finish_reason"] == "length" and same["tokens"] == big["tokens"]


def test_prompt_exactly_at_capacity(small):
    for extra in ([], ["--no-draft"]):
        out = gen(small, "--prompt-ids", ids(P30 + P12[:10]), "--max-new-tokens", 5, *extra)
        assert out["tokens"] == [] and out["finish_reason"] == "capacity"
        assert out["prompt_tokens"] == 40 and out["stats"]["rounds"] == 0


def test_prompt_longer_than_capacity(small):
    fail("generate", small, "--prompt-ids", ids(P30 + P12[:11]),
         expect=("41 tokens", "capacity", "40", "--max-seq-len"))


# ---- bad requests ----------------------------------------------------------------------------


def test_prompt_and_prompt_ids_both_or_neither(tiny):
    art = tiny[2]
    fail("generate", art, "--prompt", "hi", "--prompt-ids", "1,2", expect=("exactly one of --prompt or --prompt-ids",))
    fail("generate", art, expect=("exactly one of --prompt or --prompt-ids",))


@pytest.mark.parametrize("n", [0, -1])
def test_max_new_tokens_not_positive(plain, n):
    fail("generate", plain, "--prompt-ids", "3,4", "--max-new-tokens", n,
         expect=("max_new_tokens", "positive", f"got {n}"))


@pytest.mark.parametrize("text", ["", " , "])
def test_empty_prompt_ids(plain, text):
    fail("generate", plain, f"--prompt-ids={text}", expect=("prompt is empty",))


def test_empty_prompt_text(tiny):
    fail("generate", tiny[2], "--prompt=", expect=("prompt is empty",))


def test_prompt_ids_not_integers(plain):
    fail("generate", plain, "--prompt-ids", "1,x,3", expect=("--prompt-ids", "comma-separated integers", "1,x,3"))


@pytest.mark.parametrize("bad", [48, -1, 10**6])
def test_prompt_ids_outside_vocab(plain, bad):
    fail("generate", plain, f"--prompt-ids=3,{bad},4", expect=(f"token id {bad}", "outside the vocabulary", "[0, 48)"))


def test_prompt_text_without_tokenizer(plain):
    fail("generate", plain, "--prompt", "hello", expect=("no tokenizer", "pass token ids"))


@pytest.mark.parametrize(
    "args, expect",
    [
        (["--top-k", 99], ("top_k=99", "limit 10", "--max-top-k")),
        (["--depth", 9], ("depth=9", "limit 8", "--max-depth")),
        (["--top-k", 10, "--depth", 8, "--total-tokens", 64], ("total_tokens=64", "limit 63", "--max-total-tokens")),
        (["--top-k", 2, "--depth", 1, "--total-tokens", 7], ("total_tokens=7", "6 draft nodes", "top_k=2", "depth=1")),
        (["--top-k", 0], ("top_k must be >= 1", "got 0")),
    ],
)
def test_bad_tree_settings(plain, args, expect):
    fail("generate", plain, "--prompt-ids", "3,4", *args, expect=expect)


@pytest.mark.parametrize(
    "args, expect",
    [
        (["--temperature", -1], ("temperature must be >= 0", "0 means greedy", "got -1.0")),
        (["--temperature", "nan"], ("temperature must be a number", "got nan")),
        (["--temperature", "inf"], ("temperature must be finite",)),
        (["--temperature", 1, "--top-p", 0], ("top_p must be a number in (0, 1]", "got 0.0")),
        (["--temperature", 1, "--top-p", 1.5], ("top_p must be a number in (0, 1]", "got 1.5")),
        (["--temperature", 1, "--top-p", "nan"], ("top_p must be a number in (0, 1]", "got nan")),
        (["--temperature", 1, "--top-k-sampling", -1], ("--top-k-sampling", "integer >= 0", "got -1")),
        (["--temperature", 1, "--seed", -5], ("seed must be a non-negative integer", "got -5")),
        (["--temperature", 1, "--samples", 0], ("--samples must be >= 1", "got 0")),
    ],
)
def test_bad_sampling_settings(plain, args, expect):
    fail("generate", plain, "--prompt-ids", "3,4", *args, expect=expect)


# ---- generate: sampling ------------------------------------------------------------------------

HOT = ("--temperature", 0.9, "--top-p", 0.95, "--top-k-sampling", 20)


@pytest.mark.parametrize("mode", [(), ("--no-draft",)], ids=["eagle", "no-draft"])
def test_sampling_seed_reproduces(plain, mode):
    args = ("--prompt-ids", ids(P12), "--max-new-tokens", 20, "--ignore-eos", *HOT, *mode)
    a = gen(plain, *args, "--seed", 7)
    assert a["sampling"] == {"temperature": 0.9, "top_p": 0.95, "top_k": 20, "seed": 7}
    assert gen(plain, *args, "--seed", 7)["tokens"] == a["tokens"] and len(a["tokens"]) == 20
    assert gen(plain, *args, "--seed", 8)["tokens"] != a["tokens"]
    # Without --seed a random one is chosen and reported, so the run can be repeated.
    b = gen(plain, *args)
    assert isinstance(b["sampling"]["seed"], int)
    assert gen(plain, *args, "--seed", b["sampling"]["seed"])["tokens"] == b["tokens"]
    # The streaming output prints the same tokens.
    r = ok("generate", plain, *args, "--seed", 7)
    assert [int(x) for x in r.stdout.split()] == a["tokens"]


def test_random_seed_is_shown_without_json(plain):
    """The stats line names the seed a sampled run drew, and --seed with it repeats the run."""
    import re

    args = ("--prompt-ids", ids(P12), "--max-new-tokens", 12, "--ignore-eos", *HOT)
    r = ok("generate", plain, *args)
    seed = re.search(r"seed=(\d+),", r.stderr)
    assert seed, r.stderr
    assert ok("generate", plain, *args, "--seed", seed.group(1)).stdout == r.stdout
    assert "seed=" not in ok("generate", plain, "--prompt-ids", ids(P12), "--max-new-tokens", 4).stderr  # greedy
    assert "seeds 40..42," in ok("generate", plain, *args, "--seed", 40, "--samples", 3).stderr


def test_help_explains_the_tree_limits_and_serve_defaults():
    export = cli("export", "--help").output
    for opt in ("--max-depth", "--max-total-tokens"):
        line = " ".join(export.split(f"\n  {opt} ", 1)[1].split("\n  --", 1)[0].split())
        assert "upper bound for" in line, (opt, line)
    serve = " ".join(cli("serve", "--help").output.split())
    assert "16 tokens" in serve and "temperature 1" in serve and "64 tokens, greedy" in serve


def test_temperature_zero_is_greedy_cli(plain):
    args = ("--prompt-ids", ids(P12), "--max-new-tokens", 20, "--ignore-eos")
    greedy = gen(plain, *args)
    assert greedy["sampling"] is None
    zero = gen(plain, *args, "--temperature", 0, "--top-p", 0.5, "--top-k-sampling", 2, "--seed", 3)
    assert zero["tokens"] == greedy["tokens"] and zero["sampling"] is None


@pytest.mark.parametrize("mode", [(), ("--no-draft",)], ids=["eagle", "no-draft"])
def test_samples_are_independent_seeded_generations(plain, mode):
    args = ("--prompt-ids", ids(P12), "--max-new-tokens", 8, "--ignore-eos", *HOT, *mode)
    out = gen(plain, *args, "--seed", 40, "--samples", 4)
    assert set(out) == {"mode", "tree", "default", "guard", "sampling", "prompt_tokens", "samples"}
    assert out["mode"] == ("no-draft" if mode else "eagle") and out["prompt_tokens"] == 12
    assert out["sampling"]["seed"] == 40
    assert [s["seed"] for s in out["samples"]] == [40, 41, 42, 43]
    for s in out["samples"]:
        assert set(s) == {"seed", "tokens", "text", "finish_reason", "stats"}
        assert s["tokens"] == gen(plain, *args, "--seed", s["seed"])["tokens"]  # sample i == a run with seed+i
    assert len({tuple(s["tokens"]) for s in out["samples"]}) > 1
    # Without --json: one line of ids per sample, a summary on stderr.
    r = ok("generate", plain, *args, "--seed", 40, "--samples", 4)
    assert [[int(x) for x in line.split()] for line in r.stdout.splitlines()] == [s["tokens"] for s in out["samples"]]
    assert "[4 samples, 32 tokens" in r.stderr


def test_samples_text_lines(tiny):
    out = gen(tiny[2], "--prompt", "Hello", "--max-new-tokens", 6, "--ignore-eos", "--temperature", 1, "--seed", 1,
              "--samples", 3)
    r = ok("generate", tiny[2], "--prompt", "Hello", "--max-new-tokens", 6, "--ignore-eos", "--temperature", 1,
           "--seed", 1, "--samples", 3)
    assert [json.loads(line) for line in r.stdout.splitlines()] == [s["text"] for s in out["samples"]]


def test_generate_on_missing_artifact(tmp_path):
    fail("generate", tmp_path / "nope", "--prompt-ids", "3", expect=("not a directory", "eagle-export export"))


# ---- export ----------------------------------------------------------------------------------


def test_export_existing_dir_needs_overwrite(models, tmp_path):
    target, draft, _ = models("mha")
    out = tmp_path / "art"
    out.mkdir()
    (out / "stray.txt").write_text("old")
    args = ["export", "--target", target, "--draft", draft, "--out", out, "--max-seq-len", 64, "--quiet"]
    fail(*args, expect=(str(out), "already exists", "--overwrite"))
    assert (out / "stray.txt").read_text() == "old"
    # --overwrite never deletes a directory that is not an artifact.
    fail(*args, "--overwrite", expect=(str(out), "not an eagle-export artifact"))
    assert (out / "stray.txt").read_text() == "old"
    (out / "manifest.json").write_text("{}")  # an (old) artifact: replaced whole
    r = ok(*args, "--overwrite")
    assert f"wrote {out}" in r.stdout and "peak memory" in r.stdout and "x the weights" in r.stdout  # last line
    assert not (out / "stray.txt").exists()
    assert load_manifest(out).max_seq_len == 64
    assert not list(tmp_path.glob(".art.partial-*"))
    res = gen(out, "--prompt-ids", ids(P12), "--max-new-tokens", 5, "--ignore-eos")
    assert len(res["tokens"]) == 5


def test_export_without_tokenizer_warns(models, tmp_path, caplog, tiny):
    target, draft, _ = models("mha")
    assert not (target / "tokenizer.json").exists()
    caplog.set_level(logging.WARNING, logger="eagle_export")
    out = tmp_path / "art"
    ok("export", "--target", target, "--draft", draft, "--out", out, "--max-seq-len", 32, "--quiet")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "tokenizer" in r.getMessage()]
    assert warnings, [r.getMessage() for r in caplog.records]
    assert str(target) in warnings[0].getMessage() and "token ids" in warnings[0].getMessage()
    assert load_manifest(out).has_tokenizer is False
    assert not (out / "tokenizer.json").exists()
    # The tokenizer fixture's artifact, by contrast, carries its tokenizer.
    assert load_manifest(tiny[2]).has_tokenizer is True and (tiny[2] / "tokenizer.json").is_file()


def test_export_bad_draft_is_one_line(models, tmp_path):
    target, _, _ = models("mha")
    msg = fail("export", "--target", target, "--draft", tmp_path / "nope", "--out", tmp_path / "art", "--quiet",
               expect=("draft:", "not a directory"))
    last = msg.rstrip("\n").split("\n")[-1]
    assert last.startswith("error: draft: ") and "Traceback" not in msg
    assert not (tmp_path / "art").exists()


def test_export_eagle3_with_feature_layers(models, tmp_path):
    """An EAGLE-3 head whose fc reads 2 layers, served with --feature-layers; generate runs on it."""
    target, draft, _ = models("gqa", eagle3=True, num_feature_layers=2, feature_layers=(1, 0))
    base = ["export", "--target", target, "--draft", draft, "--max-seq-len", 64, "--quiet"]
    fail(*base, "--out", tmp_path / "a", expect=("fc.weight takes 128 input features", "--feature-layers"))
    fail(*base, "--out", tmp_path / "a", "--feature-layers", "1,x",
         expect=("--feature-layers must be comma-separated integers", "'1,x'"))
    ok(*base, "--out", tmp_path / "a", "--feature-layers", "1,0")
    m = load_manifest(tmp_path / "a")
    assert (m.variant, m.target.feature_layers, m.target.feature_dim) == ("eagle3", [1, 0], 128)
    res = gen(tmp_path / "a", "--prompt-ids", ids(P12), "--max-new-tokens", 12, "--ignore-eos")
    assert len(res["tokens"]) == 12 and res["stats"]["draft_beyond_position_limit"] is None


def test_export_overwrite_onto_a_file(models, tmp_path):
    target, draft, _ = models("mha")
    out = tmp_path / "art"
    out.write_text("not a directory")
    fail("export", "--target", target, "--draft", draft, "--out", out, "--max-seq-len", 32, "--quiet", "--overwrite",
         expect=(str(out),))


def test_export_quiet_prints_no_progress_bar(tiny, tmp_path):
    target, draft, _ = tiny
    r = ok("export", "--target", target, "--draft", draft, "--out", tmp_path / "art", "--max-seq-len", 32, "--quiet",
           "--max-batch", 3)
    assert r.stderr == "", r.stderr  # test_progress.py: the lines printed without --quiet
    m = load_manifest(tmp_path / "art")  # --max-batch is the graphs' batch range, read back as max_batch
    assert m.max_batch == 3 and all(g.axes["batch"] == [1, 3] for g in m.graphs.values())
    fail("export", "--target", target, "--draft", draft, "--out", tmp_path / "b", "--quiet", "--max-batch", 0,
         expect=("--max-batch must be an integer >= 1",))


# ---- the installed console script ------------------------------------------------------------


def _console_script() -> Path:
    exe = Path(sys.executable).parent / "eagle-export"
    assert exe.is_file(), f"console script not installed at {exe}"
    return exe


def test_console_script_help():
    r = subprocess.run([str(_console_script()), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "export" in r.stdout and "generate" in r.stdout


def test_console_script_error_has_no_traceback(tmp_path):
    r = subprocess.run([str(_console_script()), "generate", str(tmp_path / "nope"), "--prompt-ids", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("error: ") and "not a directory" in r.stderr


def test_export_no_fused_writes_the_standard_target_graph_only(models, tmp_path):
    """--no-fused --no-draft-tree: neither the fused target graph nor the draft tree graph in the artifact, and ONNX
    Runtime then runs the standard ones; the default writes all four (an mha target: head_dim 16)."""
    from eagle_export import contract as C
    from eagle_export.runtime import EagleRuntime

    target, draft, _ = models("mha")
    base = ["export", "--target", target, "--draft", draft, "--max-seq-len", 64, "--quiet"]
    ok(*base, "--out", tmp_path / "both")
    ok(*base, "--out", tmp_path / "std", "--no-fused", "--no-draft-tree")
    both = load_manifest(tmp_path / "both").graphs
    assert C.TARGET_FUSED_GRAPH in both and C.tree_graphs(both)
    m = load_manifest(tmp_path / "std")
    assert set(m.graphs) == {C.TARGET_GRAPH, C.DRAFT_GRAPH}
    assert not (tmp_path / "std" / f"{C.TARGET_FUSED_GRAPH}.onnx").exists()
    assert not list((tmp_path / "std").glob(f"{C.DRAFT_TREE_GRAPH}*"))
    with EagleRuntime.open(tmp_path / "std") as rt:
        assert rt.backend.target_graph == C.TARGET_GRAPH and rt.backend.tree_graph is None
