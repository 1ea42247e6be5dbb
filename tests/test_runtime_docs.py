"""docs/runtime.md's "Python API" examples, extracted and run exactly as printed: on the artifact the README's main
job makes (demo/eagle1), and the chat and batched ones on tiny models that have what they need (a chat template,
export --max-batch 4) under the names the examples use."""

from __future__ import annotations

import pytest
from doc_blocks import python_blocks, run_block

from eagle_export.tools.testing.tiny_models import TINY_CHAT_TEMPLATE

BLOCKS = python_blocks("docs/runtime.md", "## Python API")


def test_every_use_has_an_example():
    text = "".join(code for _, code in BLOCKS)
    assert len(BLOCKS) == 6
    for call in ("rt.generate(", "messages=", "SamplingParams(", "stream.chunks()", "rt.submit(", "achunks()"):
        assert call in text, call


@pytest.fixture(scope="module")
def workdir(trained, models, tmp_path_factory):
    root = tmp_path_factory.mktemp("docs")
    (root / "demo").mkdir()
    (root / "demo" / "eagle1").symlink_to(trained("eagle1"))
    (root / "artifacts").mkdir()
    chat = models("mha", vocab=256, with_tokenizer=True, chat_template=TINY_CHAT_TEMPLATE)[2]
    (root / "artifacts" / "chat-model").symlink_to(chat)
    (root / "artifacts" / "batched").symlink_to(models("mha", vocab=256, with_tokenizer=True, max_batch=4)[2])
    return root


@pytest.mark.parametrize("line, code", BLOCKS, ids=[f"line{n}" for n, _ in BLOCKS])
def test_runtime_doc_example_runs_as_printed(workdir, monkeypatch, capsys, line, code):
    monkeypatch.chdir(workdir)
    run_block("docs/runtime.md", line, code)
    assert capsys.readouterr().out.strip()
