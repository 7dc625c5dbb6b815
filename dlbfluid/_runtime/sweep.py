"""One resumable sweep, shared by processes: the loop that `verify` (JSON lines, one
record per scenario) and `run_experiment` (CSV, one row per scenario and trial) both run.

A sweep is a list of *units* of work. Process 0 checks the output directory (its
manifest, `dlbfluid._runtime.manifest`) and reads what is already done, dropping a torn last line
(a run killed while writing); every process learns from it which units are left, or the
error that stops them all (`Sweep.open`). The units left are computed in order, each
process its share (`Sweep.run`: whole units, `count` at a time, or each unit's rows
split over the processes), gathered on process 0 in a one-process run's order, and
appended to the results file with an fsync before the next ones start, so that a killed
run loses at most the units in flight and a rerun computes only what is missing.

The results files: `JsonLines` (records keyed by `"index"`) and `CsvRows` (rows of fixed
columns); the verbs format the rows and write their summaries.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

from .distributed import Processes

U = TypeVar("U")


def _append_durably(path: Path, write: Callable[[Any], None], newline: str | None = None):
    """Append to `path` with `write(file)`, then flush and fsync: the rows are on disk
    before the sweep goes on."""
    with open(path, "a", newline=newline) as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())


@dataclasses.dataclass(frozen=True)
class JsonLines:
    """A results file of one JSON record a line, each keyed by its `"index"`."""

    path: Path

    def read(self) -> dict[int, dict]:
        """`{index: record}` already written; a torn line (killed mid-write) or a repeated
        index is dropped, and the file rewritten without it."""
        done: dict[int, dict] = {}
        if not self.path.exists():
            return done
        lines = self.path.read_text().splitlines()
        good = []
        for line in lines:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and "index" in rec and rec["index"] not in done:
                done[rec["index"]] = rec
                good.append(line)
        if len(good) != len(lines):  # rewrite without the torn or duplicated lines
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(x + "\n" for x in good))
            os.replace(tmp, self.path)
        return done

    def append(self, records: list[dict]) -> None:
        """Append `records`, one line each, durably."""
        _append_durably(
            self.path, lambda fh: fh.writelines(json.dumps(rec) + "\n" for rec in records)
        )


@dataclasses.dataclass(frozen=True)
class CsvRows:
    """A results file of CSV rows with the header `columns`."""

    path: Path
    columns: tuple[str, ...]

    def read(self) -> list[dict]:
        """The complete rows (as strings); a torn last line is left out."""
        if not self.path.exists():
            return []
        with open(self.path, newline="") as f:
            text = f.read()
        lines = text.splitlines(keepends=True)
        if lines and not lines[-1].endswith("\n"):
            lines = lines[:-1]  # a torn last line
        rows = list(csv.DictReader(lines))
        return [r for r in rows if None not in r.values() and len(r) == len(self.columns)]

    def torn(self) -> bool:
        """Whether the file ends in a half-written line."""
        return self.path.exists() and not self.path.read_text().endswith("\n")

    def rewrite(self, rows: list[dict]) -> None:
        """Replace the file by the header and `rows` (atomically, durably)."""
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.columns)
            w.writeheader()
            w.writerows(rows)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def append(self, rows: list[dict]) -> None:
        """Append `rows` durably."""
        _append_durably(
            self.path, lambda f: csv.DictWriter(f, fieldnames=self.columns).writerows(rows), ""
        )


@dataclasses.dataclass(eq=False)
class Sweep(Generic[U]):
    """A resumable sweep over units of type `U`, shared by `processes`.

    `open_tag` and `rows_tag` name its two exchanges between the processes (what is done;
    each round's rows). `results`: where process 0 appends the rows (none: kept in memory
    only, e.g. `verify` without `out_dir`).
    """

    processes: Processes
    open_tag: str
    rows_tag: str
    results: JsonLines | CsvRows | None = None

    def open(self, read_done: Callable[[], tuple[Any, list]]) -> tuple[Any, list]:
        """`(what process 0 read, the keys of the units done)`.

        Process 0 calls `read_done() -> (anything, [key, ...])` (checking the directory,
        reading the results file); the keys, JSON-serialisable, reach every process (as
        JSON gives them back: tuples become lists), and the first value is `None` on the
        others. A `ValueError` it raises is raised on every process, none having started.
        """
        procs = self.processes
        read: Any = None
        state: dict[str, Any] | None = None
        if procs.main:
            try:
                read, keys = read_done()
            except ValueError as e:  # (told to every process: none starts)
                state = {"error": str(e)}
            else:
                state = {"done": list(keys)}
        state = procs.broadcast(state, self.open_tag)
        assert state is not None
        if "error" in state:
            raise ValueError(state["error"])
        return read, state["done"]

    def run(
        self,
        units: Sequence[U],
        compute: Callable[[U, int], list],
        on_rows: Callable[[Sequence[U], list], None] | None = None,
        *,
        whole_units: bool,
    ) -> None:
        """Compute `units` (those left) in order and append their rows as they come.

        `compute(unit, position) -> rows`: this process's rows of `unit` (`position` its
        place in `units`). `whole_units=True`: each process computes whole units, the next
        `processes.count` of them at a time (one each), so every unit is computed as in a
        one-process run; `False`: every process computes every unit, its share of the
        rows (`compute` takes `processes.share`). Process 0 gathers each round's rows in
        process order, appends them to `results` and then calls `on_rows(round's units,
        rows)`.
        """
        procs = self.processes
        step = procs.count if whole_units else 1
        for r0 in range(0, len(units), step):
            batch = units[r0 : r0 + step]
            mine = procs.share(len(batch)) if whole_units else range(len(batch))
            rows = [row for k in mine for row in compute(batch[k], r0 + k)]
            shares = procs.gather(rows, self.rows_tag)
            if shares is None:
                continue
            gathered = [row for share in shares for row in share]
            if self.results is not None:
                self.results.append(gathered)
            if on_rows is not None:
                on_rows(batch, gathered)
