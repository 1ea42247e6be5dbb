"""Shared fixtures: tiny random targets + EAGLE-1/2 or EAGLE-3 heads, exported once per test session."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from eagle_export.export.exporter import ExportOptions, export_artifact
from eagle_export.tools.testing.tiny_models import make_tiny_draft, make_tiny_eagle3_draft, make_tiny_target
from eagle_export.tree_params import TreeLimits

# Tests never download: a name that is no local path (a repo id for --target/--draft) stays on the local hub cache.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# A small vocabulary keeps random drafts' top-k covering the target's choice often enough that
# trees get accepted several levels deep, so commit and rollback paths are exercised.
SMALL_VOCAB = 48

# Tiny models gain nothing from intra-op threads; on a shared 2-core machine a second OpenMP thread that
# sleeps between the short torch calls (interleaved with ONNX Runtime calls) costs a scheduler slice per op.
torch.set_num_threads(1)


class ModelFactory:
    """Builds (target, draft, artifact) triples under one session directory, each at most once."""

    def __init__(self, root: Path):
        self.root = root
        self._cache: dict[tuple, tuple[Path, Path, Path]] = {}

    def __call__(self, preset: str = "mha", *, fc_bias: bool = True, own_embedding=False,
                 vocab: int | None = SMALL_VOCAB, with_tokenizer: bool = False, dtype: str = "fp32",
                 max_seq_len: int = 256, seed: int = 0,
                 weights_format: str = "safetensors", limits: TreeLimits | None = None,
                 eagle3: bool = False, draft_vocab: int | None = None, draft_hidden: int | None = None,
                 feature_layers: tuple[int, ...] | None = None, num_feature_layers: int = 3,
                 head: tuple = (), max_batch: int = 1, quantize=None, **target_overrides) -> tuple[Path, Path, Path]:
        """eagle3: an EAGLE-3 head (fc_bias ignored) with draft vocabulary draft_vocab (None: the target's).
        head: extra (name, value) keywords for the head writer (layouts, variants: tools/testing/tiny_models).
        max_batch: the artifact's batch range (export --max-batch). quantize: export --quantize's settings
        (export.quantize_artifact.QuantizeOptions; None: float weights)."""
        key = (preset, fc_bias, own_embedding, vocab, with_tokenizer, dtype, max_seq_len, seed, weights_format,
               limits, eagle3, draft_vocab, draft_hidden, feature_layers, num_feature_layers, head, max_batch,
               quantize, tuple(sorted(target_overrides.items())))
        if key not in self._cache:
            name = f"m{len(self._cache)}_{preset}"
            base = self.root / name
            overrides = dict(target_overrides)
            if vocab is not None:
                overrides["vocab_size"] = vocab
            target = make_tiny_target(base / "target", preset, seed=seed, with_tokenizer=with_tokenizer, **overrides)
            if eagle3:
                draft = make_tiny_eagle3_draft(base / "draft", target, seed=seed + 1, draft_vocab_size=draft_vocab,
                                               own_embedding=own_embedding, weights_format=weights_format,
                                               hidden_size=draft_hidden, num_feature_layers=num_feature_layers,
                                               **dict(head))
            else:
                draft = make_tiny_draft(base / "draft", target, seed=seed + 1, fc_bias=fc_bias,
                                        own_embedding=own_embedding, weights_format=weights_format, **dict(head))
            opts = ExportOptions(dtype=dtype, max_seq_len=max_seq_len, limits=limits or TreeLimits(),
                                 feature_layers=None if feature_layers is None else list(feature_layers),
                                 max_batch=max_batch, quantize=quantize)
            art = export_artifact(target, draft, base / "artifact", opts, progress=False)
            self._cache[key] = (target, draft, art)
        return self._cache[key]


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> ModelFactory:
    logging.getLogger("eagle_export").setLevel(logging.ERROR)
    return ModelFactory(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tiny(models):
    """The default tiny model with a tokenizer: (target, draft, artifact)."""
    return models("mha", vocab=256, with_tokenizer=True)


# Engines: a small artifact (max_seq_len 64, tree limits 4/3/12) keeps TensorRT-RTX builds to seconds.
ENGINE_MODEL = dict(preset="mha", max_seq_len=64, limits=TreeLimits(max_top_k=4, max_depth=3, max_total_tokens=12))


class EngineFactory:
    """Copies of small artifacts with TensorRT-RTX engines built into them, each built at most once per session."""

    def __init__(self, models: ModelFactory, root: Path):
        self.models = models
        self.root = root
        self._cache: dict[tuple, Path] = {}
        self.build_seconds: dict[tuple, float] = {}

    def sources(self, dtype: str = "fp32", eagle3: bool = False) -> tuple[Path, Path, Path]:
        """(target, draft, artifact without engines). eagle3: an EAGLE-3 head on a 3-layer GQA target (the
        reference's feature layers need 3)."""
        if eagle3:
            return self.models(dtype=dtype, **{**ENGINE_MODEL, "preset": "gqa"}, eagle3=True, draft_vocab=32)
        return self.models(dtype=dtype, **ENGINE_MODEL)

    def artifact(self, dtype: str = "fp32", eagle3: bool = False) -> Path:
        return self.sources(dtype, eagle3)[2]

    def __call__(self, dtype: str = "fp32", max_prefill: int | None = None, eagle3: bool = False) -> Path:
        import shutil
        import time

        from eagle_export.engines.builder import BuildOptions, build_engines

        key = (dtype,) if max_prefill is None and not eagle3 else (dtype, max_prefill, eagle3)
        if key not in self._cache:
            name = "_".join(["engines", dtype, *([f"p{max_prefill}"] if max_prefill else []),
                             *(["e3"] if eagle3 else [])])
            art = shutil.copytree(self.artifact(dtype, eagle3), self.root / name)
            t0 = time.perf_counter()
            build_engines(art, BuildOptions(engine_lib="tensorrt-rtx", max_prefill=max_prefill), progress=False)
            self.build_seconds[key] = time.perf_counter() - t0
            self._cache[key] = art
        return self._cache[key]


    def for_this_gpu(self, dtype: str = "fp32") -> Path:
        """Engines built with ``--engine-lib auto``, which takes a library that can run on the GPU present (CI's
        TensorRT-RTX engines cannot run on a data-centre GPU such as an H200)."""
        import shutil

        from eagle_export.engines.builder import BuildOptions, build_engines

        key = (dtype, "gpu")
        if key not in self._cache:
            art = shutil.copytree(self.artifact(dtype), self.root / f"engines_{dtype}_gpu")
            build_engines(art, BuildOptions(engine_lib="auto"), progress=False)
            self._cache[key] = art
        return self._cache[key]


@pytest.fixture(scope="session")
def engines(models, tmp_path_factory) -> EngineFactory:
    return EngineFactory(models, tmp_path_factory.mktemp("engines"))


# The bigram pair (tests/bigram.py): a target whose greedy output follows a fixed cycle of tokens and a head that
# drafts it exactly (every draft accepted). The cycle spells "naïve 你" in the tiny byte-level BPE (a vocabulary
# of 384 holds all 256 bytes), so two characters are split across tokens; EOS (2) is inserted after the "v".
BIGRAM_TEXT = "naïve 你"
BIGRAM_EOS_AT = 4


@pytest.fixture(scope="session")
def bigram(tmp_path_factory):
    """{"text": ..., "eos": ...} -> (target, artifact, cycle): the bigram pair without and with EOS in its cycle,
    exported with capacity 128 and the default tree (top_k 4, depth 3: 4 drafts and a bonus per round)."""
    from bigram import make_bigram_pair
    from transformers import AutoTokenizer

    from eagle_export.tools.testing.tiny_models import make_tiny_tokenizer

    root = tmp_path_factory.mktemp("bigram")
    tok = make_tiny_tokenizer(root / "tok", 384)
    text_cycle = tok(BIGRAM_TEXT, add_special_tokens=False)["input_ids"]
    assert AutoTokenizer.from_pretrained(root / "tok").decode(text_cycle) == BIGRAM_TEXT
    eos_cycle = text_cycle[:BIGRAM_EOS_AT] + [2] + text_cycle[BIGRAM_EOS_AT:]
    out = {}
    for name, cycle in (("text", text_cycle), ("eos", eos_cycle)):
        target, draft = make_bigram_pair(root / name, cycle)
        art = export_artifact(target, draft, root / name / "artifact", ExportOptions(max_seq_len=128),
                              progress=False)
        out[name] = (target, art, cycle)
    return out


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """head name -> the trained fixture exported with that head (as the demo exports it), each once per session."""
    from eagle_export.tools.commands.demo import export_fixture

    root = tmp_path_factory.mktemp("trained")
    return lambda head: export_fixture(head, root / head)
