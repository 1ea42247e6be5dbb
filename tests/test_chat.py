"""Chat prompts and end-of-turn ids: `generate --chat`, the API's ``messages=``, ``{"messages": [...]}`` lines in
the prompt files of bench, tune and validate, the missing-template error, and generation stopping on any id of
an EOS list taken from ``generation_config.json``, also inside a multi-token accepted round."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_run import cli, fail, ok
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle_export.errors import GenerationError
from eagle_export.export.exporter import ExportOptions, export_artifact
from eagle_export.manifest import load_manifest
from eagle_export.prompts import PromptFileError, read_prompts
from eagle_export.runtime import EagleRuntime
from eagle_export.tools.testing.tiny_models import TINY_CHAT_TEMPLATE

TEXT = "hello there"
TURNS = [{"role": "user", "content": "def main():"}, {"role": "assistant", "content": "pass"},
         {"role": "user", "content": "import os"}]


@pytest.fixture(scope="module")
def chat(models) -> tuple[Path, Path, Path]:
    """The conftest `tiny` model (same seeds, vocabulary 256, tokenizer) with TINY_CHAT_TEMPLATE: (target, draft,
    artifact)."""
    return models("mha", vocab=256, with_tokenizer=True, chat_template=TINY_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def reference(chat):
    """transformers' own model and tokenizer of the chat target, loaded from the checkpoint (not the artifact)."""
    lm = AutoModelForCausalLM.from_pretrained(chat[0], dtype=torch.float32).eval()
    return lm, AutoTokenizer.from_pretrained(chat[0])


def hf_chat(reference, messages, n: int) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy continuation) as transformers makes them: apply_chat_template with the generation
    prompt, then generate with the model's own generation_config (its EOS ids stop it)."""
    lm, tok = reference
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    with torch.no_grad():
        out = lm.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=n, do_sample=False)
    return list(ids), out[0, len(ids):].tolist()


def gen(artifact, *args) -> dict:
    return json.loads(ok("generate", artifact, "--json", *args).stdout)


# ---- generate --chat and messages= ------------------------------------------------------------


@pytest.mark.parametrize("extra", [[], ["--no-draft"]], ids=["eagle", "no-draft"])
def test_generate_chat_equals_transformers_on_the_chat_template(chat, reference, extra):
    ids, want = hf_chat(reference, [{"role": "user", "content": TEXT}], 24)
    plain = reference[1](TEXT)["input_ids"]
    assert ids != plain  # the template adds its markers: a --chat that sent the bare text would differ
    out = gen(chat[2], "--chat", "--prompt", TEXT, "--max-new-tokens", 24, *extra)
    assert out["prompt_tokens"] == len(ids)
    assert out["tokens"] == want
    assert out["finish_reason"] == ("eos" if want[-1] in load_manifest(chat[2]).target.eos_token_ids else "length")


def test_api_messages_multi_turn_equals_transformers(chat, reference):
    ids, want = hf_chat(reference, TURNS, 20)
    rt = EagleRuntime.open(chat[2], threads=1)
    assert rt.encode_chat(TURNS) == ids
    assert rt.generate(messages=TURNS, max_new_tokens=20).tokens == want
    chunks = list(stream := rt.stream(messages=TURNS, max_new_tokens=20))
    assert sum(chunks, []) == want and stream.result.prompt_len == len(ids)


def test_missing_chat_template_is_a_clear_error(tiny, tmp_path):
    """The conftest `tiny` artifact has a tokenizer but no chat template."""
    fail("generate", tiny[2], "--chat", "--prompt", TEXT, expect=("no chat template", str(tiny[2])))
    rt = EagleRuntime.open(tiny[2], threads=1)
    with pytest.raises(GenerationError, match="no chat template"):
        rt.generate(messages=[{"role": "user", "content": TEXT}], max_new_tokens=4)
    p = tmp_path / "chat.jsonl"
    p.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"messages": TURNS}) + "\n")
    fail("bench", tiny[2], "--prompts", p, "--max-new-tokens", 2, expect=(f"{p}:2", "no chat template"))


def test_chat_request_errors(chat, plain_art):
    fail("generate", chat[2], "--chat", "--prompt-ids", "1,2,3", expect=("--chat", "--prompt-ids"))
    rt = EagleRuntime.open(chat[2], threads=1)
    for bad, fragment in (([], "non-empty list"),
                          ([{"content": "x"}], r"messages\[0\] needs a non-empty string \"role\""),
                          ([{"role": "user", "content": 3}], "string \"content\"")):
        with pytest.raises(GenerationError, match=fragment):
            rt.generate(messages=bad, max_new_tokens=2)
    with pytest.raises(GenerationError, match="exactly one of"):
        rt.generate(TEXT, messages=TURNS, max_new_tokens=2)
    with pytest.raises(GenerationError, match="as messages="):
        rt.generate(TURNS, max_new_tokens=2)  # a conversation given as the text prompt
    no_tok = EagleRuntime.open(plain_art, threads=1)
    with pytest.raises(GenerationError, match="has no tokenizer"):
        no_tok.generate(messages=TURNS, max_new_tokens=2)


# ---- prompt files: {"messages": [...]} lines ------------------------------------------------------


def test_read_prompts_messages_lines(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in ({"prompt": "a"}, {"prompt_ids": [1, 2]}, {"messages": TURNS})))
    specs = read_prompts(p)
    assert [s.source for s in specs] == [f"{p}:1", f"{p}:2", f"{p}:3"]
    assert specs[2].messages == tuple(TURNS) and specs[2].text is None and specs[2].ids is None


@pytest.mark.parametrize("line, fragment", [
    ({"messages": []}, "non-empty list"),
    ({"messages": "hi"}, "non-empty list"),
    ({"messages": [{"role": "user"}]}, "[0] needs a string \"content\""),
    ({"messages": [{"role": "", "content": "x"}]}, "non-empty string \"role\""),
    ({"messages": TURNS, "prompt": "x"}, "each line must be"),
    ({"messages": TURNS, "system": "x"}, "unknown key(s) system"),
])
def test_read_prompts_bad_messages_line_is_named(tmp_path, line, fragment):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "ok"}) + "\n\n" + json.dumps(line) + "\n")
    with pytest.raises(PromptFileError) as e:
        read_prompts(p)
    assert f"{p}:3" in str(e.value) and fragment in str(e.value)


@pytest.fixture(scope="module")
def chat_prompts(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    p.write_text(json.dumps({"messages": TURNS}) + "\n" + json.dumps({"prompt": TEXT}) + "\n")
    return p


def test_bench_and_tune_take_messages_lines(chat, reference, chat_prompts, tmp_path):
    ids, _ = hf_chat(reference, TURNS, 1)
    text_len = len(reference[1](TEXT)["input_ids"])
    out = json.loads(ok("bench", chat[2], "--prompts", chat_prompts, "--max-new-tokens", 4, "--threads", 1,
                        "--json").stdout)
    assert [r["prompt_tokens"] for r in out["prompts"]] == [len(ids), text_len]
    assert out["aggregate"]["lossless"] is True
    art = shutil.copytree(chat[2], tmp_path / "art")
    r = cli("tune", art, "--prompts", chat_prompts, "--max-new-tokens", 3, "--threads", 1, "--top-k", 2,
            "--depth", 1, "--total-tokens", 2, "--no-refine", "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["prompts"] == 2


def test_validate_prompts_file_with_messages(chat, chat_prompts):
    r = cli("validate", chat[2], "--prompts-file", chat_prompts, "--max-new-tokens", 6, "--threads", 1, "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    greedy, eagle = rep["greedy_vs_transformers"], rep["eagle_vs_oracle"]
    assert rep["passed"] is True and greedy["prompts"] == 2 and eagle["prompts"] == 2
    assert greedy["tokens"] == 2 * 2 * 6  # EAGLE and no-draft on both prompts, EOS ignored


# ---- end-of-turn ids from a list -----------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_art(models) -> Path:
    return models("mha")[2]


P12 = [(7 * i + 3) % 48 for i in range(12)]


def _round_ends(res: dict) -> list[int]:
    """Index (in res["tokens"]) of the last token of each commit: the prefill's token, then each round's."""
    ends, n = [0], 1
    for a in res["stats"]["accept_lengths"]:
        n += a + 1
        ends.append(n - 1)
    return ends


@pytest.fixture(scope="module")
def eos_list_art(models, plain_art, tmp_path_factory):
    """The `plain` model re-exported with config.json eos_token_id = X and generation_config.json eos_token_id =
    [X, E], where X never occurs in the output and E is a token EAGLE commits strictly inside a round of >= 2
    committed tokens (tokens after it in the same round). Returns (artifact, tokens without EOS, index of E)."""
    base = gen(plain_art, "--prompt-ids", ",".join(map(str, P12)), "--max-new-tokens", 40, "--ignore-eos", "--no-guard")
    toks, ends = base["tokens"], _round_ends(base)
    inside = [i for s, e in zip(ends, ends[1:], strict=False) for i in range(s + 1, e)]  # not a round's last
    p = next(i for i in inside if toks[i] not in toks[:i])
    never = next(x for x in range(48) if x not in toks)
    target, draft, _ = models("mha")
    root = tmp_path_factory.mktemp("eos")
    tdir = shutil.copytree(target, root / "target")
    cfg = json.loads((tdir / "config.json").read_text())
    cfg["eos_token_id"] = never
    (tdir / "config.json").write_text(json.dumps(cfg))
    gcfg = json.loads((tdir / "generation_config.json").read_text())
    gcfg["eos_token_id"] = [never, toks[p]]
    (tdir / "generation_config.json").write_text(json.dumps(gcfg))
    art = export_artifact(tdir, draft, root / "art", ExportOptions(max_seq_len=256), progress=False)
    return art, toks, p


def test_manifest_records_the_eos_list(eos_list_art):
    art, toks, p = eos_list_art
    never = load_manifest(art).target.eos_token_ids[0]
    assert load_manifest(art).target.eos_token_ids == [never, toks[p]]


@pytest.mark.parametrize("extra", [["--no-guard"], ["--no-draft"]], ids=["eagle", "no-draft"])
def test_stops_on_the_second_eos_of_the_list(eos_list_art, extra):
    art, toks, p = eos_list_art
    out = gen(art, "--prompt-ids", ",".join(map(str, P12)), "--max-new-tokens", 40, *extra)
    assert out["finish_reason"] == "eos"
    assert out["tokens"] == toks[: p + 1]  # up to and including the end-of-turn id, nothing after it
    if extra != ["--no-draft"]:
        # The stop fell inside a round: that round accepted tokens past it, and none of them came out.
        assert sum(out["stats"]["accept_lengths"]) + out["stats"]["rounds"] + 1 > p + 1


def test_stream_ends_at_the_eos_inside_a_round(eos_list_art):
    art, toks, p = eos_list_art
    rt = EagleRuntime.open(art, threads=1, guard=False)  # every round drafts, as the base run's
    stream = rt.stream(prompt_ids=P12, max_new_tokens=40)
    chunks = list(stream)
    assert sum(chunks, []) == toks[: p + 1] and chunks[-1][-1] == toks[p]
    assert stream.result.finish_reason == "eos"
    assert len(chunks[-1]) < stream.result.stats.accept_lengths[-1] + 1  # the last round was cut at the EOS
