"""Heads read as the library that wrote them trained them, and `validate --against-library`.

Four cases where a head's config says other math than its writer trained (issue 27): a speculators head's own sliding
window, ModelOpt's export-time YaRN override and first-layer norm, SpecForge 0.2.0's ``norm_output``, eagle-llm
1.2.1's fixed rope base. Each head is exported with the default reading (auto) and with the wrong one forced, and the
draft graph is compared with the writer's forward by ``against_library.check_against_library`` (steps 1 and 2): the
right reading matches to 1e-4, the wrong one is flagged. The writer forwards are the real library where it installs
beside this package (nvidia-modelopt, the ``writers`` extra, which the test extra installs), else the stand-ins of
tests/writer_heads.py.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil

import numpy as np
import pytest
import torch
from cli_run import fail
from test_oracle import traced
from writer_heads import WriterForward

from eagle_export.errors import CheckpointError
from eagle_export.export.checkpoint.loaders import load_draft_head, load_target
from eagle_export.export.exporter import ExportOptions, export_artifact
from eagle_export.manifest import load_manifest
from eagle_export.runtime import EagleRuntime
from eagle_export.runtime.embedding import TokenEmbedding
from eagle_export.runtime.oracle import EagleOracle, compare_with_oracle
from eagle_export.tools.commands.validate import validate
from eagle_export.tools.commands.validate.against_library import check_against_library
from eagle_export.tools.testing.tiny_models import make_tiny_draft, make_tiny_eagle3_draft, make_tiny_target
from eagle_export.tree_params import TreeLimits, TreeParams

TOL = 1e-4
WINDOW = 4
LIMITS, TREE = TreeLimits(max_top_k=4, max_depth=3, max_total_tokens=12), TreeParams(3, 3, 8)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("readings") / "target", "gqa", seed=0, with_tokenizer=False,
                            num_hidden_layers=4)


def export(target, draft, out, reading="auto", **kw):
    opts = ExportOptions(max_seq_len=48, limits=kw.pop("limits", LIMITS), tree=TREE, fused=False, head_reading=reading)
    return export_artifact(target, draft, out, opts, progress=False)


def against(art, draft, fwd):
    m = load_manifest(art)
    return check_against_library(art, m, draft, TokenEmbedding.open(art, m), fwd=fwd)


def edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        node, key = (cfg["transformer_layer_config"], k[4:]) if k.startswith("tlc_") else (cfg, k)
        node[key] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def real_library_agrees(art, draft, library: str) -> None:
    """validate's adapter runs the library's own modules where it is installed (``pip install --no-deps``: its pins
    conflict with ours), else skips naming how to install it."""
    real = against(art, draft, None)
    print(real.format())
    if real.skipped is not None:
        assert f"{library} is not installed" in real.skipped and "pip install --no-deps" in real.skipped, real.skipped
    else:
        assert real.passed and real.max_logprob_error < TOL, real.format()


def test_speculators_sliding_window_is_kept(target, tmp_path):
    """A speculators head with sliding_window 4: the graph equals the windowed forward over 12-row steps (3x the
    window), the runtime equals the oracle round by round on prompts past 3x the window, and the same head exported
    with its window ignored (layer_types full_attention) is flagged."""
    draft = make_tiny_eagle3_draft(tmp_path / "spec", target, seed=3, layout="speculators",
                                   layer_types=["sliding_attention"], sliding_window=WINDOW)
    art = export(target, draft, tmp_path / "art")
    m = load_manifest(art)
    assert (m.draft.options["sliding_window"], m.draft.options["sliding_layers"]) == (WINDOW, [0])
    fwd = WriterForward(draft, target, "speculators")
    ok = against(art, draft, fwd)
    print(ok.format())
    assert ok.passed and ok.max_logprob_error < TOL and ok.top1_agree == ok.rows == 24, ok.format()

    rt, oracle = EagleRuntime.open(art, threads=1), EagleOracle.load(target, draft)
    prompt = np.random.default_rng(1).integers(3, m.target.vocab_size, 3 * WINDOW + 1).tolist()
    res, rounds = traced(rt, prompt, 16, TREE)
    cmp = compare_with_oracle(res.tokens, rounds, oracle.generate(prompt, 16, TREE, m.max_seq_len), 1e-4)
    assert cmp.status == "match", cmp.detail
    with torch.no_grad():  # lossless past 3x the window
        want = oracle.lm.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                  pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert res.tokens == want[0, len(prompt):].tolist()

    skipped = against(art, draft, None)  # speculators 0.9.0 needs torch 2.14 with CUDA wheels: no adapter
    assert skipped.passed and "speculators cannot be installed beside this package" in skipped.skipped

    ignored = edit_config(draft, tmp_path / "nowin", tlc_layer_types=["full_attention"])
    bad = against(export(target, ignored, tmp_path / "art-nowin"), draft, fwd)
    print(bad.format())
    assert not bad.passed and bad.max_logprob_error > 10 * TOL, bad.format()

    with pytest.raises(CheckpointError, match=r"sliding_window 4 .* smaller than --max-depth 5"):
        export(target, draft, tmp_path / "deep", limits=TreeLimits(max_top_k=4, max_depth=5, max_total_tokens=12))


@pytest.mark.parametrize("norm_output", [True, False])
def test_specforge_020_norm_output(target, tmp_path, caplog, norm_output):
    """SpecForge 0.2.0 (transformers_version 5.8.1, which it pins): norm_output read its way by default; SGLang's
    reading (forced with config) is flagged, at step 2 only for norm_output true (what is fed back differs)."""
    draft = make_tiny_eagle3_draft(tmp_path / "sf", target, seed=5, layout="specforge", norm_output=norm_output,
                                   transformers_version="5.8.1")
    fwd = WriterForward(draft, target, "specforge-0.2")
    with caplog.at_level(logging.WARNING, "eagle_export"):
        art = export(target, draft, tmp_path / "auto")
    assert "read as SpecForge 0.2.0 trained it" in caplog.text
    ok = against(art, draft, fwd)
    print(ok.format())
    assert ok.passed and ok.max_logprob_error < TOL, ok.format()
    real_library_agrees(art, draft, "specforge")
    bad = against(export(target, draft, tmp_path / "config", reading="config"), draft, fwd)
    print(bad.format())
    assert not bad.passed, bad.format()


def test_eagle_llm_rope_base(target, tmp_path, caplog):
    """An EAGLE-1 head whose config copied rope_theta 500000: the files do not name the writer, so the config is
    read (with a notice naming the option); eagle-llm 1.2.1's forward (base 10000) flags it, and
    --head-reading eagle-llm-1.2 matches it."""
    draft = make_tiny_draft(tmp_path / "el", target, seed=6, rope_theta=500000.0)
    fwd = WriterForward(draft, target, "eagle-llm-1.2")
    with caplog.at_level(logging.WARNING, "eagle_export"):
        art = export(target, draft, tmp_path / "auto")
    assert "--head-reading eagle-llm-1.2" in caplog.text
    bad = against(art, draft, fwd)
    print(bad.format())
    assert not bad.passed, bad.format()
    forced = export(target, draft, tmp_path / "forced", reading="eagle-llm-1.2")
    ok = against(forced, draft, fwd)
    assert ok.passed and ok.max_logprob_error < TOL, ok.format()
    real_library_agrees(forced, draft, "eagle-llm")


def test_reading_and_vocabulary_refusals(target, tmp_path):
    t = load_target(target, progress=False)
    sf = make_tiny_eagle3_draft(tmp_path / "sf", target, seed=7, layout="specforge")
    fail("export", "--target", target, "--draft", sf, "--out", tmp_path / "art", "--head-reading", "modelopt",
         expect=("--head-reading modelopt applies to modelopt-eagle3 heads; this head is specforge-eagle3",))
    # A d2t that training never filled (all zeros, no t2d) with a smaller draft vocabulary: the mapping is missing.
    mo = make_tiny_eagle3_draft(tmp_path / "mo", target, seed=7, layout="modelopt", draft_vocab_size=32,
                                num_feature_layers=2)
    from safetensors.torch import load_file, save_file

    w = load_file(str(mo / "model.safetensors"))
    w["d2t"] = torch.zeros_like(w["d2t"])
    save_file(w, str(mo / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"d2t is all zeros .* \(the mapping is missing\)"):
        load_draft_head(mo, t)


# ---- the real library, where it installs (the `writers` extra) ------------------------------------------------


class InMemoryModelOpt:
    """ModelOpt's own EagleModule as it trained (the converted model, not re-read from files)."""

    library, version = "nvidia-modelopt (in memory)", ""

    def __init__(self, model):
        self.module = model.eagle_module
        # ModelOpt's _eagle_forward: the module's own lm_head, else the base model's (exported as lm_head.weight)
        self.lm_head = getattr(self.module, "lm_head", None) or model._base_model_lm_head

    @torch.no_grad()
    def __call__(self, features, fed, embeds, positions, mask):
        z = torch.cat((self.module.fc(features), fed))
        add = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)[None, None]
        post, pre, _ = self.module(z[None], embeds[None], attention_mask=add, position_ids=positions[None])
        return pre[0], torch.log_softmax(self.lm_head(post[0]).float(), -1)


def init_rope(module) -> None:
    """ModelOpt's own rotary init; it passes device=, which transformers 5.23's LlamaRotaryEmbedding no longer
    takes: then the same class, built as ModelOpt builds it, without the keyword."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    try:
        module._maybe_init_rope()
    except TypeError:
        module.rotary_emb = LlamaRotaryEmbedding(config=module.config)


def test_modelopt_library_head(target, tmp_path, caplog):
    """A head made by nvidia-modelopt itself (mtsp.convert, export_speculative_decoding) matches ModelOpt's own
    forward to 1e-4 with the notice printed; validate's adapter, which rebuilds ModelOpt's module from the files,
    agrees, and flags the config reading."""
    mtsp = pytest.importorskip("modelopt.torch.speculative", reason="nvidia-modelopt is not installed (the "
                                                                    "writers extra)")
    from modelopt.torch.export import export_speculative_decoding
    from modelopt.torch.speculative.config import EAGLE3_DEFAULT_CFG
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    cfg = copy.deepcopy(EAGLE3_DEFAULT_CFG)["config"]
    cfg["eagle_architecture_config"].update(intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=16)
    cfg["eagle_use_torch_compile"] = False
    mtsp.convert(model, [("eagle", cfg)])
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():  # stands in for training: no weight stays at its init (norms at 1 hide a norm's order)
        for p in model.eagle_module.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
    init_rope(model.eagle_module)
    draft = tmp_path / "modelopt-head"
    export_speculative_decoding(model, export_dir=draft)
    assert json.loads((draft / "config.json").read_text())["rope_scaling"]["rope_type"] == "yarn"
    with caplog.at_level(logging.WARNING, "eagle_export"):
        art = export(target, draft, tmp_path / "auto")
    assert "read as NVIDIA ModelOpt trained it" in caplog.text
    own = against(art, draft, InMemoryModelOpt(model))
    print(own.format())
    assert own.passed and own.max_logprob_error < TOL and own.max_state_error < TOL, own.format()
    report = validate(art, prompts=0, threads=1, against_library=True)  # validate's own path, with its adapter
    adapter = report.library
    print(adapter.format())
    assert adapter.skipped is None and adapter.passed and adapter.max_logprob_error < TOL, adapter.format()
    assert report.passed and "draft graph vs nvidia-modelopt 0.47.0 forward: PASS" in report.format()
    bad = against(export(target, draft, tmp_path / "config", reading="config"), draft, None)
    print(bad.format())
    assert not bad.passed and bad.skipped is None, bad.format()
