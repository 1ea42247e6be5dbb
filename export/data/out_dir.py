"""The output folder of an export: one writer per ``--out`` at a time, a partial folder renamed into place, and the
partial folders of exports that died (``kill -9``, a crash, a power cut) found and removed.

An export holds ``.NAME.lock`` (an ``flock``, beside ``NAME``) from its first check of ``NAME`` until ``NAME`` is in
place. A second export into the same folder fails at once with a message naming the first one's pid. The lock dies
with its process, so a killed export never blocks the next one; and while an export holds it, every
``.NAME.partial-*`` folder beside ``NAME`` belongs to an export that is gone: it is reported and removed.

Without ``--overwrite`` an existing ``NAME`` is never replaced, not even one that a process not taking the lock
(a copy, an older eagle-export) put there while this export ran: the rename into place refuses, and the export
fails keeping what is there. With it, the old folder is moved aside first and removed only once the new one is in
place. Nothing is removed that the export did not write, except the stale partial folders it reports.

The lock is ~30 lines of ``fcntl`` rather than a library's: the lock file is removed when the export ends (none is
left beside the artifact), which is only safe with the inode check in ``_acquire``, and the error names the holder.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from eagle_export.errors import EagleExportError
from eagle_export.manifest import MANIFEST_NAME

log = logging.getLogger(__name__)


def lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}.lock"


def partial_prefix(out: Path) -> str:
    """The name prefix of this process's partial folders for ``out`` (the pid says whose they were)."""
    return f".{out.name}.partial-{os.getpid()}-"


def _partial_pattern(out: Path) -> re.Pattern:
    # ours: .NAME.partial-PID-XXXXXXXX[-old]; eagle-export before the lock: .NAME.partial-XXXXXXXX (mkdtemp's suffix)
    return re.compile(rf"^\.{re.escape(out.name)}\.partial-(\d+-)?[a-z0-9_]{{8}}(-old)?$")


@contextmanager
def parent_folders(out: Path) -> Iterator[None]:
    """Create ``out``'s missing parent folders (the lock file lives there); a failed export removes them again,
    deepest first, as long as they are empty."""
    missing = []
    p = out.parent
    while not p.exists():
        missing.append(p)
        p = p.parent
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        for d in missing:
            try:
                d.rmdir()
            except OSError:
                break
        raise


class OutputLock:
    """Held while an export checks and writes ``out``; entering fails at once when another export holds it."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.path = lock_path(self.out)
        self._fd: int | None = None

    def __enter__(self) -> OutputLock:
        self._fd = self._acquire()
        return self

    def _acquire(self) -> int:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise EagleExportError(
                    f"another export is writing {self.out} (pid {holder}; lock file {self.path}): wait for it to "
                    "finish, or choose another --out") from None
            # The holder we waited on removes the file as it finishes: a lock on that removed file is no lock.
            try:
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return fd

    def __exit__(self, *exc) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink()  # while still locked: the next export then locks a new file (see _acquire)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None


def remove_stale_partials(out: Path) -> list[Path]:
    """Remove (and report) the partial folders of ``out`` left by exports that are gone. Call with the lock held:
    every export into ``out`` holds it while its partial folder exists, so the ones found now are orphans."""
    if not out.parent.is_dir():
        return []
    pattern = _partial_pattern(out)
    removed = []
    for p in sorted(out.parent.iterdir()):
        if not pattern.match(p.name) or not p.is_dir() or p.is_symlink():
            continue
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())
        pid = p.name.split(".partial-", 1)[1].split("-")[0]
        who = f"pid {pid}" if pid.isdigit() else "an older eagle-export"
        shutil.rmtree(p, ignore_errors=True)
        log.warning("removed %s (%.1f MiB): the partial output of an export into %s that did not finish (%s)",
                    p, size / 2**20, out, who)
        removed.append(p)
    return removed


def make_partial(out: Path) -> Path:
    """A new partial folder beside ``out``, with the permissions of an ordinary new folder (mkdtemp's are 0700)."""
    tmp = Path(tempfile.mkdtemp(prefix=partial_prefix(out), dir=out.parent))
    tmp.chmod(0o777 & ~_umask())
    return tmp


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def share_files(folder: Path) -> None:
    """Give every file the mode an ordinary new file gets (0644 under umask 022). onnx writes external data files
    0600, which locks out other users and containers that mount the artifact."""
    mode = 0o666 & ~_umask()
    for f in folder.iterdir():
        if f.is_file() and not f.is_symlink():
            f.chmod(mode)


def check_replaceable(out: Path) -> None:
    """``--overwrite`` replaces an eagle-export artifact or an empty folder, nothing else."""
    if not out.is_dir() or out.is_symlink():
        raise EagleExportError(f"{out} exists and is not a directory: refusing to replace it")
    if any(out.iterdir()) and not (out / MANIFEST_NAME).is_file():
        raise EagleExportError(f"{out} is a non-empty directory that is not an eagle-export artifact: refusing to "
                               "replace it")


def publish(tmp: Path, out: Path, overwrite: bool) -> None:
    """Move the finished partial folder ``tmp`` to ``out``; the caller removes ``tmp`` if this raises."""
    share_files(tmp)
    if not os.path.lexists(out):
        try:
            os.rename(tmp, out)  # refuses a non-empty folder that appeared since the check (ENOTEMPTY/EEXIST)
            return
        except OSError as e:
            if not os.path.lexists(out):
                raise
            raise EagleExportError(f"{out} appeared while this export ran (another process wrote it): it is left "
                                   f"as it is and this export's result is discarded ({e.strerror})") from None
    if not overwrite:
        raise EagleExportError(f"{out} appeared while this export ran (another process wrote it): it is left as it "
                               "is and this export's result is discarded (pass --overwrite to replace it)")
    check_replaceable(out)
    old = tmp.with_name(tmp.name + "-old")
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)
