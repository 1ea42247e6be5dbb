"""`--target` / `--draft` as Hugging Face repo ids (export and validate): resolved through a hub cache the tests
lay out themselves as huggingface_hub does (models--org--name/{blobs, snapshots/<commit>, refs/main}), with
HF_HUB_OFFLINE=1 so nothing is ever downloaded; a local directory wins; a repo not in the cache is one line."""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path

import pytest
from cli_run import fail, ok

from eagle_export.export.checkpoint.hub import resolve_checkpoint
from eagle_export.manifest import load_manifest

P12 = [(7 * i + 3) % 48 for i in range(12)]
REV_A = "a" * 40
REV_B = "b" * 40


def add_to_cache(cache: Path, repo_id: str, files: Path | dict[str, bytes], commit: str, ref: str | None = "main"):
    """Store ``files`` (a directory, or {relative path: bytes}) as snapshot ``commit`` of model repo ``repo_id``,
    laid out as huggingface_hub's cache: contents in blobs/<hash>, snapshots/<commit>/<path> relative symlinks to
    them, refs/<ref> holding the commit. Returns the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    if isinstance(files, Path):
        files = {str(f.relative_to(files)): f.read_bytes() for f in sorted(files.rglob("*")) if f.is_file()}
    snap = repo / "snapshots" / commit
    for rel, data in files.items():
        digest = hashlib.sha256(data).hexdigest()
        blob = repo / "blobs" / digest
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref is not None:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture
def no_network(monkeypatch):
    """Every name lookup or connection attempt is recorded and fails as on a machine without network; the test
    then checks that none was made (HF_HUB_OFFLINE honoured: cache only)."""
    attempts: list[str] = []

    def refuse_lookup(host, *args, **kwargs):
        attempts.append(f"getaddrinfo {host}")
        raise socket.gaierror(socket.EAI_NONAME, "no network in the tests")

    def refuse_connect(self, address):
        attempts.append(f"connect {address}")
        raise OSError("no network in the tests")

    monkeypatch.setattr(socket, "getaddrinfo", refuse_lookup)
    monkeypatch.setattr(socket.socket, "connect", refuse_connect)
    yield attempts
    assert attempts == [], f"network attempted while HF_HUB_OFFLINE=1: {attempts}"


@pytest.fixture
def offline_cache(tmp_path, monkeypatch, no_network) -> Path:
    """An empty hub cache named by HF_HUB_CACHE, offline, with no network attempt allowed."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


@pytest.fixture(scope="module")
def plain(models):
    return models("mha")


def cached_plain(cache: Path, plain) -> tuple[Path, Path]:
    """The `plain` target and head as repos org/tiny-target (refs/main -> REV_A, plus an older broken REV_B) and
    org/tiny-head. Returns their main snapshots."""
    add_to_cache(cache, "org/tiny-target", {"config.json": b"{}"}, REV_B)  # main moves on to REV_A below
    t = add_to_cache(cache, "org/tiny-target", plain[0], REV_A)
    d = add_to_cache(cache, "org/tiny-head", plain[1], REV_A)
    return t, d


def test_export_from_repo_ids_in_the_cache(plain, offline_cache, tmp_path):
    snap_t, snap_d = cached_plain(offline_cache, plain)
    out = tmp_path / "art"
    ok("export", "--target", "org/tiny-target", "--draft", "org/tiny-head", "--out", out, "--max-seq-len", 256,
       "--quiet")
    m = load_manifest(out)
    assert Path(m.target.source) == snap_t.resolve() and Path(m.draft.source) == snap_d.resolve()
    args = ("--prompt-ids", ",".join(map(str, P12)), "--max-new-tokens", 20, "--ignore-eos", "--json")
    got = json.loads(ok("generate", out, *args).stdout)["tokens"]
    assert got == json.loads(ok("generate", plain[2], *args).stdout)["tokens"]


def test_validate_takes_repo_ids(plain, offline_cache):
    snap_t, snap_d = cached_plain(offline_cache, plain)
    r = ok("validate", plain[2], "--target", "org/tiny-target", "--draft", "org/tiny-head", "--prompts", 1,
           "--max-new-tokens", 4, "--threads", 1, "--json")
    rep = json.loads(r.stdout)
    assert rep["passed"] is True
    assert rep["reference"]["target"] == str(snap_t) and rep["reference"]["draft"] == str(snap_d)


def test_hf_home_and_refs_main(tmp_path, monkeypatch, no_network):
    """Without HF_HUB_CACHE the cache is $HF_HOME/hub; the snapshot is the one refs/main names."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "home" / "hub"
    a = add_to_cache(cache, "org/m", {"config.json": b'{"v": "a"}'}, REV_A)
    b = add_to_cache(cache, "org/m", {"config.json": b'{"v": "b"}'}, REV_B, ref=None)
    assert resolve_checkpoint("org/m", "--target") == a
    (cache / "models--org--m" / "refs" / "main").write_text(REV_B)
    assert resolve_checkpoint("org/m", "--target") == b
    assert json.loads((resolve_checkpoint("org/m", "--target") / "config.json").read_text()) == {"v": "b"}


def test_an_existing_local_directory_wins(offline_cache, tmp_path, monkeypatch):
    add_to_cache(offline_cache, "org/m", {"config.json": b"{}"}, REV_A)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "m").mkdir(parents=True)
    assert resolve_checkpoint("org/m", "--target") == Path("org/m")
    (tmp_path / "org" / "m").rmdir()
    assert resolve_checkpoint("org/m", "--target") == offline_cache / "models--org--m" / "snapshots" / REV_A


def test_repo_not_in_the_cache_offline_is_one_line(plain, offline_cache, tmp_path):
    cached_plain(offline_cache, plain)
    out = tmp_path / "art"
    msg = fail("export", "--target", "org/absent", "--draft", "org/tiny-head", "--out", out,
               expect=("--target org/absent", "no such directory", str(offline_cache), "HF_HUB_OFFLINE"))
    assert msg.count("\n") == 1
    fail("export", "--target", "org/tiny-target", "--draft", "absent-head", "--out", out,
         expect=("--draft absent-head", "HF_HUB_OFFLINE"))
    fail("validate", plain[2], "--draft", "org/absent", expect=("--draft org/absent", "HF_HUB_OFFLINE"))
    assert not out.exists()
    # Not a directory and not shaped like a repo id: the loader's own error about the path.
    fail("export", "--target", tmp_path / "no" / "such" / "dir", "--draft", "org/tiny-head", "--out", out,
         expect=(str(tmp_path / "no" / "such" / "dir"),))


# ---- online: which files are fetched -----------------------------------------------------------------


def fake_snapshot_download(remote: Path, snap: Path, calls: list):
    """Stands in for ``snapshot_download(repo, allow_patterns=patterns)`` on a repo whose files are ``remote``:
    as documented, it fetches every file whose repo path matches one of the glob patterns (fnmatch) into the
    snapshot directory, and returns that directory."""
    import fnmatch
    import shutil

    def fetch(patterns: list[str]) -> Path:
        calls.append(list(patterns))
        snap.mkdir(parents=True, exist_ok=True)
        for f in sorted(remote.rglob("*")):
            rel = f.relative_to(remote).as_posix()
            if f.is_file() and any(fnmatch.fnmatch(rel, p) for p in patterns):
                (snap / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f, snap / rel)
        return snap

    return fetch


def _index(shards: list[str]) -> str:
    return json.dumps({"metadata": {}, "weight_map": {f"w{i}": s for i, s in enumerate(shards)}})


@pytest.mark.parametrize("repo, fetched", [
    pytest.param({"config.json": "{}", "tokenizer.json": "{}", "README.md": "",
                  "model.safetensors.index.json": _index(["model-1-of-2.safetensors", "model-2-of-2.safetensors"]),
                  "model-1-of-2.safetensors": "", "model-2-of-2.safetensors": "", "consolidated.safetensors": "",
                  "pytorch_model.bin": "", "original/consolidated.00.pth": ""},
                 {"config.json", "tokenizer.json", "model.safetensors.index.json", "model-1-of-2.safetensors",
                  "model-2-of-2.safetensors"}, id="sharded-safetensors"),
    pytest.param({"config.json": "{}", "model.safetensors": "", "pytorch_model.bin": "", "extra.safetensors": ""},
                 {"config.json", "model.safetensors"}, id="safetensors-and-bin"),
    pytest.param({"config.json": "{}", "pytorch_model.bin": "", "training_args.bin": ""},
                 {"config.json", "pytorch_model.bin"}, id="reference-eagle-head-bin"),
    pytest.param({"config.json": "{}", "pytorch_model.bin.index.json": _index(["a.bin", "b.bin"]), "a.bin": "",
                  "b.bin": "", "c.bin": ""},
                 {"config.json", "pytorch_model.bin.index.json", "a.bin", "b.bin"}, id="sharded-bin"),
])
def test_online_fetches_the_one_set_of_weights_the_loaders_read(tmp_path, repo, fetched):
    from eagle_export.export.checkpoint.hub import fetch_weights

    remote = tmp_path / "remote"
    for rel, text in repo.items():
        (remote / rel).parent.mkdir(parents=True, exist_ok=True)
        (remote / rel).write_text(text)
    calls: list = []
    snap = fetch_weights(fake_snapshot_download(remote, tmp_path / "snap", calls))
    assert {f.relative_to(snap).as_posix() for f in snap.rglob("*") if f.is_file()} == fetched
    assert len(calls) <= 3
