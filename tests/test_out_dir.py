"""The export's output folder: one export per --out at a time, an existing artifact never replaced without
--overwrite, the partial folders of killed exports found and removed, files readable by others."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle_export.errors import EagleExportError
from eagle_export.export.data.out_dir import OutputLock, lock_path, publish
from eagle_export.export.exporter import ExportOptions, export_artifact
from eagle_export.manifest import MANIFEST_NAME, load_manifest

OPTS = dict(max_seq_len=32)


def _export_cmd(tiny, out: Path, *extra) -> list[str]:
    target, draft, _ = tiny
    return [sys.executable, "-m", "eagle_export.cli", "export", "--target", str(target), "--draft", str(draft),
            "--out", str(out), "--max-seq-len", "32", "--quiet", *extra]


def _leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


def test_two_concurrent_exports_into_one_out_one_succeeds(tiny, tmp_path):
    out = tmp_path / "art"
    procs = [subprocess.Popen(_export_cmd(tiny, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(300), p.stderr.read()) for p in procs]
    codes = sorted(rc for rc, _ in results)
    assert codes == [0, 2], results  # never two successes (one result silently lost)
    err = next(e for rc, e in results if rc == 2)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    # the loser either met the winner's lock or (if it came later) the finished artifact
    assert "another export is writing" in err or "already exists" in err, err
    assert load_manifest(out).max_seq_len == 32
    assert _leftovers(tmp_path, "art") == []  # no lock file, no partial folder


def test_an_export_fails_at_once_while_another_holds_the_lock(tiny, tmp_path):
    target, draft, _ = tiny
    out = tmp_path / "art"
    with OutputLock(out):  # what a running export holds (an flock: a second open file description conflicts)
        with pytest.raises(EagleExportError, match=rf"another export is writing .*art \(pid {os.getpid()}; "):
            export_artifact(target, draft, out, ExportOptions(**OPTS), progress=False)
        assert not out.exists() and _leftovers(tmp_path, "art") == [".art.lock"]
    assert _leftovers(tmp_path, "art") == []  # the holder removes its lock file
    export_artifact(target, draft, out, ExportOptions(**OPTS), progress=False)  # and the next export runs


def test_releasing_the_lock_closes_its_descriptor(tmp_path):
    """An export's lock file descriptor is closed when the lock is released (a long-lived process exporting many
    artifacts must not collect open descriptors of removed lock files)."""
    out = tmp_path / "art"
    for _ in range(3):
        with OutputLock(out) as lock:
            fd = lock._fd
            assert fd is not None and os.fstat(fd).st_ino == os.stat(lock_path(out)).st_ino
        with pytest.raises(OSError) as info:
            os.fstat(fd)  # closed: EBADF (nothing else opened a file in between to reuse the number)
        assert info.value.errno == errno.EBADF
        assert lock._fd is None and not lock_path(out).exists()


def test_a_lock_taken_on_a_removed_lock_file_is_not_held(tmp_path, monkeypatch):
    """The race the inode check in ``OutputLock._acquire`` closes: export B opens the lock file while export A still
    holds it, A finishes (removes the file, releases its flock), then B's flock succeeds, on a file no longer in
    the folder. A third export C would create a new lock file and lock it too: two exports writing one --out. B
    must see that its lock is on a removed file, and lock the file that is there instead, so that C is refused."""
    out = tmp_path / "art"
    a = OutputLock(out).__enter__()
    first_inode = os.fstat(a._fd).st_ino
    real_flock = fcntl.flock
    calls = []

    def a_finishes_first(fd, op):  # B's first flock: A has ended between B's open and B's flock
        calls.append(os.fstat(fd).st_ino)
        if len(calls) == 1:
            a.__exit__(None, None, None)
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", a_finishes_first)
    with OutputLock(out) as b:
        monkeypatch.setattr(fcntl, "flock", real_flock)
        with pytest.raises(EagleExportError, match=rf"another export is writing .*art \(pid {os.getpid()}; "):
            with OutputLock(out):  # C: the lock file in the folder is B's, and B holds it
                pass
        assert os.fstat(b._fd).st_ino == os.stat(lock_path(out)).st_ino  # (the freed inode may be reused)
        assert calls[0] == first_inode and len(calls) == 2  # B locked the removed file once, then the new one
    assert not lock_path(out).exists()


def _partial(parent: Path, name: str) -> Path:
    tmp = parent / name
    tmp.mkdir()
    (tmp / MANIFEST_NAME).write_text("{}")
    return tmp


def test_an_artifact_that_appeared_meanwhile_is_never_replaced(tmp_path):
    out = tmp_path / "art"
    out.mkdir()
    (out / "theirs.txt").write_text("written by someone else")
    tmp = _partial(tmp_path, ".art.partial-1-abcdefgh")
    with pytest.raises(EagleExportError, match="appeared while this export ran.*--overwrite"):
        publish(tmp, out, overwrite=False)
    assert sorted(p.name for p in out.iterdir()) == ["theirs.txt"]
    # --overwrite replaces an artifact (its old folder removed once the new one is in place), nothing else
    (out / MANIFEST_NAME).write_text("{}")
    publish(tmp, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST_NAME]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    tmp = _partial(tmp_path, ".notes.partial-1-abcdefgh")
    with pytest.raises(EagleExportError, match="not an eagle-export artifact"):
        publish(tmp, other, overwrite=True)
    assert sorted(p.name for p in other.iterdir()) == ["keep.txt"]


def test_a_killed_exports_partial_folder_is_reported_and_removed(tiny, tmp_path, caplog):
    target, draft, _ = tiny
    out = tmp_path / "art"
    proc = subprocess.Popen(_export_cmd(tiny, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not list(tmp_path.glob(".art.partial-*")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    assert proc.poll() is None, "the export ended before its partial folder was seen"
    proc.send_signal(signal.SIGKILL)  # kill -9: no cleanup runs
    proc.wait(30)
    (killed,) = tmp_path.glob(".art.partial-*")
    assert killed.name.startswith(f".art.partial-{proc.pid}-") and not out.exists()
    assert lock_path(out).exists()  # left behind, but its flock died with the process
    older = _partial(tmp_path, ".art.partial-abcdefgh")  # the name eagle-export gave them before the lock
    keep = [_partial(tmp_path, n) for n in (".art2.partial-1-abcdefgh", ".art.partial-x.partial-1-abcdefgh")]
    with caplog.at_level(logging.WARNING, logger="eagle_export"):
        export_artifact(target, draft, out, ExportOptions(**OPTS), progress=False)
    for gone in (killed, older):
        assert not gone.exists()
        assert f"removed {gone}" in caplog.text
    assert f"did not finish (pid {proc.pid})" in caplog.text and "an older eagle-export" in caplog.text
    assert all(k.is_dir() for k in keep)  # other outputs' partial folders are not this export's business
    assert _leftovers(tmp_path, "art") == [keep[1].name] and load_manifest(out).max_seq_len == 32


def test_artifact_files_get_ordinary_permissions(tiny, tmp_path):
    target, draft, _ = tiny
    before = os.umask(0o022)
    try:
        out = export_artifact(target, draft, tmp_path / "art", ExportOptions(**OPTS), progress=False)
    finally:
        os.umask(before)
    assert oct(out.stat().st_mode & 0o777) == oct(0o755)
    modes = {f.name: oct(f.stat().st_mode & 0o777) for f in out.iterdir()}
    assert any(n.endswith(".onnx.data") for n in modes)  # (onnx writes these 0600)
    assert set(modes.values()) == {oct(0o644)}, modes
