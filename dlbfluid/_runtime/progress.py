"""One progress reporter for every long-running verb (simulate, verify, experiment, ...).

On a terminal it redraws one line (`\\r`); otherwise (a log file, CI) it writes a full
line at most every `interval` seconds and at the end, so that a log shows progress
without drowning in it. Each line says what is done, how long it took and, once some
work is done, the estimated time left.
"""

from __future__ import annotations

import sys
import time


def _clock(s: float) -> str:
    s = max(float(s), 0.0)
    if s < 60:
        return f"{s:.1f}s"
    m, sec = divmod(int(round(s)), 60)
    if m < 60:
        return f"{m}m{sec:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"


class Progress:
    """`Progress(label, total)`; call `update(done, note="")` as work completes.

    **Arguments:** `label` (what is progressing), `total` (units of work), `enabled`
    (False: silent), `stream` (default `sys.stderr`), `interval` (seconds between lines
    when the stream is not a terminal), `unit` (shown after the counts).
    """

    def __init__(
        self,
        label: str,
        total: int,
        *,
        enabled: bool = True,
        stream=None,
        interval: float = 10.0,
        unit: str = "",
    ):
        self.label, self.total, self.enabled = label, max(int(total), 1), enabled
        self.stream = sys.stderr if stream is None else stream
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = interval
        self.unit = f" {unit}" if unit else ""
        self.t0 = time.perf_counter()
        self._last = -float("inf")
        self._first_done: int | None = None
        self.done = 0

    def update(self, done: int, note: str = "", *, start: int | None = None) -> None:
        """Report `done` units finished (`start`: units already done when this run began,
        e.g. on resume, so that the estimate counts only this run's rate)."""
        if not self.enabled:
            return
        self.done = int(done)
        if self._first_done is None:
            self._first_done = self.done if start is None else int(start)
        first: int = self._first_done
        now = time.perf_counter()
        el = now - self.t0
        frac = min(self.done / self.total, 1.0)
        ran = self.done - first
        left = self.total - self.done
        eta = f", ~{_clock(el / ran * left)} left" if ran > 0 and left > 0 else ""
        tail = f"  {note}" if note else ""
        final = self.done >= self.total
        if self.tty:
            bar = "#" * int(30 * frac)
            self.stream.write(
                f"\r{self.label} [{bar:<30}] {self.done}/{self.total}{self.unit} "
                f"{_clock(el)}{eta}{tail:<28}"
            )
            if final:
                self.stream.write("\n")
        elif final or now - self._last >= self.interval or self.done == first:
            self.stream.write(
                f"{self.label}: {self.done}/{self.total}{self.unit} ({100 * frac:.0f}%) in "
                f"{_clock(el)}{eta}{tail}\n"
            )
            self._last = now
        self.stream.flush()

    def __call__(self, *args) -> None:
        """Count one more unit (the callback form used inside compiled loops)."""
        self.update(self.done + 1)
