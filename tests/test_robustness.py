"""Bad inputs not covered by test_manifest / test_cli / test_loaders: several threads on one runtime,
a missing tokenizer, a manifest from another model, truncated weights, an export interrupted half-way.
Each ends in a clear error (or, for threads, in correct results), never a bare traceback.

TensorRT engine files are built in CI (test_engine_build.py); their bad cases (missing or truncated engine
files, no CUDA device) are in test_trt_backend.py, and `validate --backend tensorrt` refusing with a clear
message in test_validate.py."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from eagle_export.cli import main
from eagle_export.errors import GenerationError, ManifestError
from eagle_export.export import exporter
from eagle_export.export.exporter import ExportOptions, export_artifact
from eagle_export.manifest import MANIFEST_NAME, load_manifest
from eagle_export.runtime import EagleRuntime

PROMPTS = [[(7 * i + 3 * j) % 48 for i in range(5 + j)] for j in range(6)]


@pytest.fixture(scope="module")
def plain(models) -> Path:
    return models("mha")[2]


def cli_error(*args) -> str:
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), r.output
    assert "Traceback" not in r.output and r.stderr.startswith("error: "), r.stderr
    return r.stderr


# ---- threads -------------------------------------------------------------------------------------


def test_threads_on_one_runtime_are_serialised_and_correct(plain):
    """Generations from several threads on one runtime run one at a time, each with the right result."""
    rt = EagleRuntime.open(plain, threads=1)
    want = [rt.generate(prompt_ids=p, max_new_tokens=16, stop_on_eos=False).tokens for p in PROMPTS]
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    log: list[int] = []  # which stream produced each chunk, in the order chunks arrive
    start = threading.Barrier(len(PROMPTS))

    def work(i: int) -> None:
        try:
            start.wait()
            stream = rt.stream(prompt_ids=PROMPTS[i], max_new_tokens=16, stop_on_eos=False)
            for _ in stream:
                log.append(i)
            got[i] = stream.result.tokens
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert [got[i] for i in range(len(PROMPTS))] == want
    # One generation at a time on the shared buffers: each stream's chunks arrive as one unbroken run.
    runs = [i for j, i in enumerate(log) if j == 0 or log[j - 1] != i]
    assert sorted(runs) == list(range(len(PROMPTS))), runs
    assert not rt._lock._lock.locked()


def test_streams_from_two_threads_do_not_interleave(plain):
    """While one thread holds a stream open, another thread's generation waits, then runs correctly."""
    rt = EagleRuntime.open(plain, threads=1)
    want = rt.generate(prompt_ids=PROMPTS[1], max_new_tokens=12, stop_on_eos=False).tokens
    first = rt.stream(prompt_ids=PROMPTS[0], max_new_tokens=12, stop_on_eos=False)
    it = iter(first)
    next(it)  # the stream now holds the runtime
    result: dict[str, list[int]] = {}
    t = threading.Thread(target=lambda: result.update(
        tokens=rt.generate(prompt_ids=PROMPTS[1], max_new_tokens=12, stop_on_eos=False).tokens))
    t.start()
    t.join(timeout=1.0)
    assert t.is_alive() and "tokens" not in result  # blocked behind the open stream
    for _ in it:
        pass
    t.join(timeout=60)
    assert result["tokens"] == want


def test_same_thread_second_generation_is_refused(plain):
    rt = EagleRuntime.open(plain, threads=1)
    it = iter(rt.stream(prompt_ids=PROMPTS[0], max_new_tokens=8))
    next(it)
    with pytest.raises(GenerationError, match="already has a generation open on this runtime"):
        rt.generate(prompt_ids=PROMPTS[1], max_new_tokens=4)
    it.close()  # closing the stream frees the runtime
    assert len(rt.generate(prompt_ids=PROMPTS[1], max_new_tokens=4, stop_on_eos=False).tokens) == 4


# ---- artifact files ------------------------------------------------------------------------------


def test_missing_tokenizer(tiny, tmp_path):
    art = shutil.copytree(tiny[2], tmp_path / "art")
    assert load_manifest(art).has_tokenizer
    (art / "tokenizer.json").unlink()
    with pytest.raises(ManifestError, match="lists a tokenizer but tokenizer.json / tokenizer.model is missing"):
        EagleRuntime.open(art)
    msg = cli_error("generate", art, "--prompt", "hello")
    assert str(art) in msg and "re-export" in msg


def test_unreadable_tokenizer(tiny, tmp_path):
    art = shutil.copytree(tiny[2], tmp_path / "art")
    (art / "tokenizer.json").write_text("{not json")
    msg = cli_error("generate", art, "--prompt-ids", "3,4")
    assert "could not load the tokenizer" in msg and str(art) in msg


def test_manifest_from_another_model(plain, tiny, tmp_path):
    """Same layer names, other dimensions: the mismatch is found when the graphs load, not mid-generation."""
    art = shutil.copytree(plain, tmp_path / "art")
    shutil.copy2(tiny[2] / MANIFEST_NAME, art / MANIFEST_NAME)  # 256-token vocabulary, this graph has 48
    with pytest.raises(ManifestError) as info:
        EagleRuntime.open(art)
    msg = str(info.value)
    assert "logits" in msg and "48" in msg and "256" in msg and "another model" in msg
    cli_error("generate", art, "--prompt-ids", "3,4")


def test_truncated_weights_file(plain, tmp_path):
    art = shutil.copytree(plain, tmp_path / "art")
    data = art / "target_verify.onnx.data"  # the weights of both target graphs
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    msg = cli_error("generate", art, "--prompt-ids", "3,4")
    assert "could not load graph" in msg and "target_verify_fused.onnx" in msg and "re-export" in msg


# ---- export interrupted --------------------------------------------------------------------------


def interrupt_second_graph(monkeypatch, exc: BaseException) -> list[str]:
    """Let the target graphs trace (standard and fused), then fail while the draft graph is being written."""
    calls: list[str] = []
    real = exporter._export_graph

    def flaky(module, args, spec, path, *lean):
        calls.append(spec.name)
        if spec.name == "draft_step":
            path.write_bytes(b"half a graph")  # a partly written file, as a real interruption leaves
            raise exc
        real(module, args, spec, path, *lean)

    monkeypatch.setattr(exporter, "_export_graph", flaky)
    return calls


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), MemoryError("out of memory")], ids=["ctrl-c", "error"])
def test_interrupted_export_leaves_nothing(models, tmp_path, monkeypatch, exc):
    target, draft, _ = models("mha")
    calls = interrupt_second_graph(monkeypatch, exc)
    out = tmp_path / "art"
    with pytest.raises(type(exc)):
        export_artifact(target, draft, out, ExportOptions(max_seq_len=32), progress=False)
    assert calls == ["target_verify", "target_verify_fused", "draft_step"]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no artifact, no .art.partial-*


def test_interrupted_overwrite_keeps_the_old_artifact(models, tmp_path, monkeypatch):
    target, draft, _ = models("mha")
    out = export_artifact(target, draft, tmp_path / "art", ExportOptions(max_seq_len=32), progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    interrupt_second_graph(monkeypatch, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        export_artifact(target, draft, out, ExportOptions(max_seq_len=64, overwrite=True), progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
    assert len(EagleRuntime.open(out).generate(prompt_ids=[3, 4], max_new_tokens=3).tokens) <= 3


def test_killed_export_is_never_taken_for_an_artifact(models, tmp_path, monkeypatch):
    """A process killed mid-export runs no cleanup: its work directory stays, but is never a finished export."""
    target, draft, _ = models("mha")
    interrupt_second_graph(monkeypatch, KeyboardInterrupt())
    monkeypatch.setattr(exporter.shutil, "rmtree", lambda *a, **k: None)  # as if killed: no cleanup ran
    out = tmp_path / "art"
    with pytest.raises(KeyboardInterrupt):
        export_artifact(target, draft, out, ExportOptions(max_seq_len=32), progress=False)
    assert not out.exists()
    [partial] = tmp_path.glob(".art.partial-*")
    assert (partial / "target_verify.onnx").is_file() and not (partial / MANIFEST_NAME).exists()
    with pytest.raises(ManifestError, match="did not finish"):
        load_manifest(partial)
    msg = cli_error("generate", partial, "--prompt-ids", "3")
    assert "no manifest.json" in msg and msg.count("\n") == 1
