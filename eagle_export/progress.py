"""Progress of long steps (export, build): a tqdm bar on a terminal, one line per finished step elsewhere.

Redrawn bars are for terminals: written to a pipe, a CI log or ``2>file`` they leave hundreds of ``\\r`` frames,
and a message printed while one is open lands in the middle of its line. So every bar is made here:
``progress_bar`` gives a tqdm bar when stderr is a terminal, a ``StepLines`` (one complete line per
``update``) when it is not, and a disabled bar with ``--quiet``. ``end_open_bars`` closes what is still open,
so an error printed next starts on its own line. ``setup_logging`` routes log messages through ``tqdm.write``, so
a warning printed while a bar is open gets a line of its own and the bar is redrawn below it.
"""

from __future__ import annotations

import logging
import sys
import weakref

from tqdm.auto import tqdm

_open: weakref.WeakSet = weakref.WeakSet()  # bars made here and not closed yet


class StepLines:
    """tqdm's calls as the exporter and builder use them, printing ``desc: n/total units (postfix)`` per update."""

    def __init__(self, total: int, desc: str, unit: str, file):
        self.total, self.desc, self.unit, self.file = total, desc, unit, file
        self.n = 0
        self.postfix = ""

    def set_description(self, desc: str, refresh: bool = True) -> None:
        self.desc = desc

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def update(self, n: int = 1) -> None:
        self.n += n
        line = f"{self.desc}: {self.n}/{self.total} {self.unit}s" + (f" ({self.postfix})" if self.postfix else "")
        print(line, file=self.file, flush=True)

    def close(self) -> None:
        _open.discard(self)


def terminal_bars(enabled: bool = True) -> bool:
    """Whether redrawn bars (ours, or a library's such as transformers' loading bar) may be shown now."""
    isatty = getattr(sys.stderr, "isatty", None)  # looked up per call: stderr may be replaced (tests, redirection)
    return enabled and isatty is not None and bool(isatty())


def progress_bar(total: int, desc: str, unit: str, enabled: bool = True):
    """A bar over ``total`` steps on stderr: tqdm on a terminal, ``StepLines`` otherwise, silent when not enabled."""
    if not enabled:
        return tqdm(total=total, disable=True)
    if terminal_bars():
        bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr)
    else:
        bar = StepLines(total, desc, unit, sys.stderr)
    _open.add(bar)
    return bar


def end_open_bars() -> None:
    """Close every bar still open (an error interrupted its step), so what is printed next starts a line."""
    for bar in list(_open):
        _open.discard(bar)
        bar.close()


class BarSafeHandler(logging.Handler):
    """Log records to the stderr of the moment, through ``tqdm.write``: on a terminal it clears an open bar's line,
    prints the message on its own line and redraws the bar (elsewhere there is no bar and it is a plain write)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging's own contract: report, never raise
            self.handleError(record)


def setup_logging(level: int = logging.WARNING) -> None:
    """The CLI's logging: ``LEVEL: message`` lines on stderr that never land inside a progress bar's line (unless
    the application configured logging already)."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = BarSafeHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level)
