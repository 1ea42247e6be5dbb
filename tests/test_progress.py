"""Progress output of long steps: a bar on a terminal, one line per step elsewhere, nothing with --quiet, and an
error always on its own line.

The CLI tests run with click's captured stderr, which is not a terminal (as a CI log, a pipe or ``2>file``). The
terminal case is a StringIO that says it is a TTY (tqdm then redraws its bar with ``\\r``, as on a terminal).
"""

from __future__ import annotations

import io
import sys

import pytest
from cli_run import cli, ok

from eagle_export import progress
from eagle_export.cli import main
from eagle_export.errors import CheckpointError
from eagle_export.export.exporter import ExportOptions, export_artifact

# contract 6: one draft tree graph per top_k up to the default tree's
EXPORT_LINES = ["export: 1/7 steps (loading target)", "export: 2/7 steps (loading draft)",
                "export: 3/7 steps (tracing target verify graph)", "export: 4/7 steps (tracing fused target graph)",
                "export: 5/7 steps (tracing draft step graph)",
                "export: 6/7 steps (tracing draft tree graphs (top_k 1, 2, 3, 4))",
                "export: 7/7 steps (writing tokenizer and manifest)"]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def export_args(tiny, out, *extra):
    target, draft, _ = tiny
    return ("export", "--target", target, "--draft", draft, "--out", out, "--max-seq-len", 32, *extra)


def test_export_prints_one_line_per_step_when_stderr_is_not_a_terminal(tiny, tmp_path):
    r = ok(*export_args(tiny, tmp_path / "art"))
    assert "\r" not in r.stderr
    assert r.stderr.splitlines() == EXPORT_LINES


def test_export_quiet_prints_nothing(tiny, tmp_path):
    r = ok(*export_args(tiny, tmp_path / "art", "--quiet"))
    assert r.stderr == ""


def test_an_error_mid_export_starts_its_own_line(tiny, tmp_path):
    target, _, _ = tiny
    r = cli("export", "--target", target, "--draft", tmp_path / "no-such-head", "--out", tmp_path / "art",
            "--max-seq-len", 32)
    assert r.exit_code == 2, r.output
    lines = r.stderr.splitlines()
    assert "\r" not in r.stderr
    assert lines[:-1] == EXPORT_LINES[:1]  # the target was loaded, then the draft failed
    assert lines[-1].startswith("error: ") and "no-such-head" in lines[-1]
    assert not (tmp_path / "art").exists()


def test_on_a_terminal_the_bar_redraws_and_an_error_starts_its_own_line(tiny, tmp_path, monkeypatch):
    """tqdm on a (stand-in) terminal; the CLI's error handler closes the interrupted bar before printing."""
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    target, _, _ = tiny
    args = ["export", "--target", str(target), "--draft", str(tmp_path / "no-such-head"), "--out",
            str(tmp_path / "art"), "--max-seq-len", "32"]
    with pytest.raises(SystemExit) as e:
        main.main(args, standalone_mode=False)
    assert e.value.code == 2
    out = term.getvalue()
    assert "\r" in out and "1/7" in out  # a redrawn bar, one step done
    before, sep, after = out.partition("error: ")
    assert sep and before.endswith("\n"), repr(out[-300:])
    assert "no-such-head" in after and after.endswith("\n")


def test_bars_closed_by_end_open_bars_only_once(monkeypatch):
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    bar = progress.progress_bar(3, "x", "step")
    bar.update()
    progress.end_open_bars()
    assert term.getvalue().endswith("\n")
    n = len(term.getvalue())
    bar.close()
    progress.end_open_bars()
    assert len(term.getvalue()) == n  # nothing redrawn after the close
    assert progress.progress_bar(3, "x", "step", enabled=False).disable


def test_export_artifact_progress_false_writes_nothing(tiny, tmp_path, capsys):
    target, draft, _ = tiny
    export_artifact(target, draft, tmp_path / "art", ExportOptions(max_seq_len=32), progress=False)
    with pytest.raises(CheckpointError):
        export_artifact(target, tmp_path / "none", tmp_path / "art2", ExportOptions(max_seq_len=32), progress=False)
    assert capsys.readouterr().err == ""


def test_a_warning_on_a_real_terminal_gets_its_own_line(tiny, tmp_path):
    """A pseudo-terminal as stderr (the real case, in a fresh process): the export's draft position warning (a
    head trained to 36 positions, capacity 32 + depth 8) comes while the step bar is drawn; it must start a line,
    not follow the bar's text, and the bar goes on below it."""
    import fcntl
    import json
    import os
    import pty
    import shutil
    import struct
    import subprocess
    import termios

    target, draft, _ = tiny
    draft = shutil.copytree(draft, tmp_path / "draft")
    cfg = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 36}))
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # 120 columns (0: tqdm draws nothing)
    proc = subprocess.Popen([sys.executable, "-m", "eagle_export.cli", "export", "--target", str(target), "--draft",
                             str(draft), "--out", str(tmp_path / "art"), "--max-seq-len", "32"],
                            stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO once the child has exited and closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(60) == 0, out.decode(errors="replace")
    text = out.decode(errors="replace")
    before, sep, after = text.partition("WARNING: ")
    assert sep and "positions reach 40" in after.split("\n", 1)[0], text
    assert "1/7" in before, repr(text)  # the bar was drawn (target loaded, loading draft) when the warning came
    assert before.endswith(("\r", "\n")), repr(before[-160:])  # the bar's line was cleared first
    assert "7/7" in after  # and the bar went on below it
