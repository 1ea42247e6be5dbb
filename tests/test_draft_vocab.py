"""`export --draft-vocab N`: the draft's lm_head cut to N target tokens (export/checkpoint/draft_vocab.py,
export/graphs/heads.py ``prune_vocab``), on the trained fixture with both heads.

- lossless: EAGLE tokens equal --no-draft tokens on the fixture's prompts, the guard off so every round drafts, through
  the draft tree graph (the default tree) and the step graph (a top_k no tree graph was traced for);
- every id the draft proposes is a kept target id (a missing id map would propose draft ids, which are positions in
  the kept list, not target ids);
- the kept set is the N most frequent of the corpus, counted here with the tokenizer itself (EOS first, ties by id);
- bad N or corpus: one line, exit 2; the manifest records the setting, an inconsistent record is refused.
"""

from __future__ import annotations

import json
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import torch
from cli_run import fail
from safetensors.torch import load_file
from tokenizers import Tokenizer

from eagle_export.errors import ManifestError
from eagle_export.export.checkpoint.draft_vocab import choose
from eagle_export.export.exporter import ExportOptions, export_artifact
from eagle_export.manifest import MANIFEST_NAME, load_manifest, read_draft_vocab
from eagle_export.prompts import read_prompts
from eagle_export.runtime import EagleRuntime
from eagle_export.tools.commands.demo import FIXTURE, fixture_tree
from eagle_export.tree_params import TreeParams

KEEP = 256  # of the target's 2048 (EAGLE-1/2) and of the EAGLE-3 head's 1024
EOS = 2  # the fixture tokenizer's </s>


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """About 12 kB of standard-library Python (the fixture's kind of text), one tokenizer batch: counted here in one
    piece exactly as the exporter counts it."""
    text = Path(textwrap.__file__).read_text()[:12000]
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(text[: text.rfind("\n") + 1])
    return path


@pytest.fixture(scope="module")
def pruned(tmp_path_factory, corpus):
    """head -> the fixture exported with --draft-vocab KEEP ranked by ``corpus``, once per module. Tree graphs for the
    default tree's top_k only, so a top_k-3 tree drafts with the step graph."""
    root = tmp_path_factory.mktemp("pruned")
    made: dict[str, Path] = {}

    def get(head: str) -> Path:
        if head not in made:
            tree = fixture_tree(head)
            out = root / head
            export_artifact(FIXTURE / "target", FIXTURE / head, out,
                            ExportOptions(max_seq_len=960, tree=tree, draft_tree_top_k=(tree.top_k,),
                                          draft_vocab=KEEP, draft_vocab_corpus=corpus), progress=False)
            made[head] = out
        return made[head]

    return get


def _head_vocab(head: str) -> list[int]:
    """The target ids a fixture head drafts over before pruning: all of them (EAGLE-1/2), or its d2t's (EAGLE-3)."""
    if head == "eagle1":
        return list(range(2048))
    d2t = load_file(str(FIXTURE / head / "model.safetensors"))["d2t"]
    return (torch.arange(len(d2t)) + d2t).tolist()


@pytest.mark.parametrize("head", ["eagle1", "eagle3"])
def test_pruned_draft_is_lossless_and_proposes_kept_ids(pruned, head):
    art = pruned(head)
    m = load_manifest(art)
    kept = set(read_draft_vocab(art, m))
    assert m.draft.vocab_size == KEEP and not m.draft.d2t_identity
    assert kept != set(range(KEEP))  # draft ids (0..KEEP-1) are not target ids here: a missing map shows
    rt = EagleRuntime.open(art, threads=1, guard=False)
    proposed: list[int] = []
    prompts = [p.text for p in read_prompts(FIXTURE / "prompts.jsonl")][:6]
    taus = []
    for tree in (m.tree_defaults, TreeParams(3, 3, 8)):  # the tree graph, then the step graph (no top_k-3 graph)
        for prompt in prompts:
            ids = rt.encode(prompt)
            want = rt.generate(prompt_ids=ids, max_new_tokens=40, use_draft=False, stop_on_eos=False).tokens
            got = rt.generate(prompt_ids=ids, max_new_tokens=40, tree=tree, stop_on_eos=False,
                              on_round=lambda vt, acc: proposed.extend(vt.tokens[1:].tolist()))
            assert got.tokens == want, (head, tree, prompt)
            taus.append(got.stats.tau)
    assert proposed and set(proposed) <= kept, sorted(set(proposed) - kept)[:10]
    assert sum(taus) / len(taus) > 1.5  # the pruned draft still gets tokens accepted


@pytest.mark.parametrize("head", ["eagle1", "eagle3"])
def test_kept_set_is_the_corpus_top_n(pruned, corpus, head):
    art = pruned(head)
    m = load_manifest(art)
    text = corpus.read_text()
    counts = Counter(Tokenizer.from_file(str(FIXTURE / "target" / "tokenizer.json"))
                     .encode(text, add_special_tokens=False).ids)
    vocab = _head_vocab(head)
    want = sorted(sorted(vocab, key=lambda t: (t != EOS, -counts[t], t))[:KEEP])
    assert read_draft_vocab(art, m) == want
    v = m.draft_vocab
    assert (v.ranking, v.size, v.pruned_from, v.corpus) == ("corpus", KEEP, len(vocab), str(corpus.resolve()))
    assert v.corpus_tokens == sum(counts.values())
    assert EOS in want and counts[EOS] == 0  # kept although plain text never shows it


def test_token_id_ranking_without_corpus():
    """No corpus: the lowest ids of the head's vocabulary (the tokenizer's merge order), EOS always among them."""
    kept, info = choose(4, torch.arange(2048), [2047], None, None, 2048, progress=False)
    assert kept.tolist() == [0, 1, 2, 2047] and info.ranking == "token-id" and info.pruned_from == 2048
    head3 = torch.tensor([5, 9, 40, 41, 300])  # an EAGLE-3 head's target ids
    kept, _ = choose(3, head3, [300], None, None, 2048, progress=False)
    assert kept.tolist() == [5, 9, 300]


def test_merge_rank_without_corpus():
    """No corpus, a BPE tokenizer: tokens ranked by the first merge that makes or uses them (counted here from
    tokenizer.json's merges), EOS first. Plain id order would keep the byte alphabet (ids 3-258), rare bytes too."""
    model = json.loads((FIXTURE / "target" / "tokenizer.json").read_text())["model"]
    vocab, merges = model["vocab"], model["merges"]
    first: dict[int, int] = {}
    for i, m in enumerate(merges):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        for tok in (a, b, a + b):
            first.setdefault(vocab[tok], i)
    want = sorted(sorted(range(2048), key=lambda t: (t != EOS, first.get(t, len(merges)), t))[:300])
    kept, info = choose(300, torch.arange(2048), [EOS], None, FIXTURE / "target", 2048, progress=False)
    assert info.ranking == "merge-rank" and kept.tolist() == want
    assert vocab["ĠĠ"] in want and vocab["ł"] not in want  # a first merge in, a byte no merge uses (id 257) out


def test_old_manifest_loads_and_a_bad_record_is_refused(pruned, models, tmp_path):
    assert load_manifest(models("mha")[2]).draft_vocab is None  # made without --draft-vocab
    src = pruned("eagle1")
    m = load_manifest(src)
    assert m.to_dict()["draft_vocab"]["size"] == KEEP
    art = tmp_path / "copy"
    art.mkdir()
    for f in src.iterdir():
        (art / f.name).symlink_to(f)
    (art / MANIFEST_NAME).unlink()
    raw = json.loads((src / MANIFEST_NAME).read_text())
    for edit, fragment in ((lambda r: r["draft_vocab"].update(size=KEEP + 1), "draft_vocab.size"),
                           (lambda r: r["draft_vocab"].update(ranking="merges"), "draft_vocab.ranking"),
                           (lambda r: r.pop("draft_vocab"), "no draft_vocab entry")):
        bad = json.loads(json.dumps(raw))
        edit(bad)
        (art / MANIFEST_NAME).write_text(json.dumps(bad))
        with pytest.raises(ManifestError, match=fragment):
            load_manifest(art)


@pytest.fixture(scope="module")
def binary(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("binary") / "weights.bin"
    path.write_bytes(bytes(range(256)) * 8)
    return path


@pytest.mark.parametrize("head, args, expect", [
    ("eagle1", ["--draft-vocab", "0"], ("--draft-vocab must be a positive number", "0")),
    ("eagle1", ["--draft-vocab", "-3"], ("--draft-vocab must be a positive number",)),
    ("eagle1", ["--draft-vocab", "2048"], ("below the target's vocabulary (2048 tokens)",)),
    ("eagle3", ["--draft-vocab", "1024"], ("below the EAGLE-3 head's draft vocabulary (1024 tokens)",)),
    ("eagle1", ["--draft-vocab", "5"], ("--draft-vocab 5 is below --max-top-k 10",)),
    ("eagle1", ["--draft-vocab", "100", "--draft-vocab-corpus", "MISSING"], ("cannot read it",)),
    ("eagle1", ["--draft-vocab", "100", "--draft-vocab-corpus", "BINARY"], ("not a text file",)),
    ("eagle1", ["--draft-vocab-corpus", "BINARY"], ("--draft-vocab-corpus needs --draft-vocab N",)),
])
def test_bad_draft_vocab_is_one_line(tmp_path, binary, head, args, expect):
    args = [{"MISSING": str(tmp_path / "nope.txt"), "BINARY": str(binary)}.get(a, a) for a in args]
    fail("export", "--target", FIXTURE / "target", "--draft", FIXTURE / head, "--out", tmp_path / "out", "--quiet",
         *args, expect=expect)
    assert not (tmp_path / "out").exists()


def test_a_level_of_the_pruned_draft_ranks_fewer_tokens(pruned):
    """The EAGLE-1/2 step graph holds a KEEP-row lm_head and no full-vocabulary matrix (the cost the option saves)."""
    import onnx

    art = pruned("eagle1")
    m = load_manifest(art)
    model = onnx.load(str(art / m.graphs["draft_step"].file), load_external_data=False)
    dims = {tuple(d for d in i.dims) for i in model.graph.initializer}
    assert any(KEEP in d and 192 in d and len(d) == 2 for d in dims)
    assert not any(2048 in d and len(d) == 2 for d in dims)  # no full-vocabulary matrix left in the draft


@pytest.mark.parametrize("eagle3, keep, lean", [(False, 24, True), (True, 16, False)])
def test_validate_prunes_its_reference_alike(models, tmp_path, eagle3, keep, lean):
    """validate compares every draft graph and the EAGLE rounds with a PyTorch reference pruned to the artifact's
    kept ids (a reference over the whole vocabulary fails the draft graphs). EAGLE-1/2 through the lean export path,
    whose lm_head rows are read from the checkpoint; EAGLE-3 cut within its d2t (32 of the target's 48)."""
    from eagle_export.tools.commands.validate import validate

    target, draft, _ = models("gqa", eagle3=True, draft_vocab=32) if eagle3 else models("mha")
    art = export_artifact(target, draft, tmp_path / "art",
                          ExportOptions(max_seq_len=256, draft_vocab=keep, lean_threshold_bytes=0 if lean else 1 << 40),
                          progress=False)
    m = load_manifest(art)
    assert m.draft_vocab.ranking == "token-id" and m.draft.vocab_size == keep
    report = validate(art, prompts=1, max_new_tokens=8, threads=1)
    assert report.passed, report.format()
