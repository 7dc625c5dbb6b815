"""The manifest of a resumable output directory: which command wrote it, with which
settings and which dlbfluid version, so that a rerun resumes only the same run.

A resumable command (`verify`, `run_experiment`) appends its results to a directory and a
rerun with the same directory carries on where a killed run stopped. Results computed with
other settings must never be mixed in or relabelled, so the directory records, in
`manifest.json`,

    {"command": "verify", "version": "0.2.0", "config": {...}}

the command, the package version and every setting that changes any number of the
results (and none that does not, e.g. `verify`'s `chunk`, so that those may change between
runs). `open_manifest` creates it in a new directory and, in a directory that has one,
refuses (`ValueError`) a different command, version or configuration, naming each
changed field with its old and new value.

**Directories written before manifests existed.** Results found without a manifest are
refused, since nothing says which settings produced them, unless the command recorded its
configuration another way: `run_experiment` always wrote `config.json`, which is then
compared like a manifest's configuration (its version is unrecorded, so it is adopted) and
the manifest is added, so that those directories keep resuming. `verify` recorded nothing:
its `results.jsonl` without a manifest is refused.

This module imports nothing from JAX.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import dlbfluid

MANIFEST = "manifest.json"


def package_version() -> str:
    """`dlbfluid.__version__`, read when called (a test may set another)."""
    return str(dlbfluid.__version__)


def _plain(obj):
    """`obj` as JSON reads it back (tuples become lists, keys strings), for comparison."""
    return json.loads(json.dumps(obj))


def _show(value) -> str:
    return "(not recorded)" if value is _MISSING else repr(value)


_MISSING = object()


def _changes(old: Mapping, new: Mapping, labels: Mapping[str, str]) -> list[str]:
    out = []
    for key in list(new) + [k for k in old if k not in new]:
        a, b = old.get(key, _MISSING), new.get(key, _MISSING)
        if a != b:
            name = f"{key} ({labels[key]})" if key in labels else key
            out.append(f"{name}: {_show(a)} -> {_show(b)}")
    return out


def _write(path: Path, manifest: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(manifest, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def open_manifest(
    out: str | Path,
    command: str,
    config: Mapping,
    *,
    flag: str = "out_dir",
    labels: Mapping[str, str] | None = None,
    adopt: Mapping | None = None,
    results: Iterable[str] = (),
) -> bool:
    """Create or check `out/manifest.json` before anything in `out` is read or written.

    **Arguments:**

    - `out`: the output directory (created if absent).
    - `command`: the command's name, e.g. `"verify"`.
    - `config`: every setting that changes any number of the results (JSON-serialisable).
    - `flag`: the name of `out` in the messages: the caller's argument (default
      `out_dir`), or the command line's option (`--out`).
    - `labels`: another name of each configuration field for the messages, e.g. the
      command line's option (`{"seed": "--seed"}` gives `seed (--seed): 0 -> 1`); without
      one a field is named alone (`seed: 0 -> 1`).
    - `adopt`: for a directory without a manifest, the configuration that an older
      version recorded in its own way (e.g. `run_experiment`'s `config.json`): when equal
      to `config` the directory is adopted (the manifest is written, with this version).
    - `results`: the result files (names inside `out`) that, found non-empty without a
      manifest or an `adopt`, mean results of unknown settings: refused.

    **Returns:** `True` when the directory already held this run (a resume), `False`
    for a new one (the manifest has been written).

    **Raises:** `ValueError` naming `flag` and `out`, and each difference: another
    command, another package version (results may differ between versions), each
    changed field with its old and new value; or results without a manifest. Nothing in
    `out` is modified then.
    """
    out = Path(out)
    labels = {} if labels is None else labels
    path = out / MANIFEST
    version = package_version()
    new = {"command": command, "version": version, "config": _plain(dict(config))}
    where = f"{flag} = {str(out)!r} is invalid"
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            old, why = None, str(e)
        else:
            why = "expected an object with 'command', 'version' and 'config'"
        if not (isinstance(old, dict) and isinstance(old.get("config"), dict)):
            raise ValueError(
                f"{where}: its {MANIFEST} is not a dlbfluid manifest ({why}); choose a new {flag}"
            )
        if old.get("command") != command:
            raise ValueError(
                f"{where}: it holds the results of dlbfluid {old.get('command')!r}, not of "
                f"{command!r}; choose a new {flag}"
            )
        changed = _changes(old["config"], new["config"], labels)
        if old.get("version") != version:
            changed.append(
                f"dlbfluid version: {_show(old.get('version', _MISSING))} -> {version!r} "
                "(results may differ between versions)"
            )
        if changed:
            same = "the same options"
            if old.get("version") != version:
                same += f" and dlbfluid {old.get('version')}"
            raise ValueError(
                f"{where}: it holds a different {command} run (changed: {'; '.join(changed)}); "
                f"resume with {same} or choose a new {flag}"
            )
        return True
    if adopt is not None:
        changed = _changes(_plain(dict(adopt)), new["config"], labels)
        if changed:
            raise ValueError(
                f"{where}: it holds a different {command} run (changed: {'; '.join(changed)}); "
                f"resume with the same options or choose a new {flag}"
            )
        _write(path, new)
        return True
    found = [n for n in results if (out / n).is_file() and (out / n).stat().st_size > 0]
    if found:
        raise ValueError(
            f"{where}: it holds {', '.join(found)} but no {MANIFEST} (written by a dlbfluid "
            "that recorded no settings), so nothing says which settings produced those "
            f"results; choose a new {flag} (or delete "
            f"{', '.join(str(out / n) for n in found)} to start over)"
        )
    out.mkdir(parents=True, exist_ok=True)
    _write(path, new)
    return False


def resume_note(out: str | Path, done: int, total: int, unit: str) -> None:
    """`resuming N of M <unit> done in DIR` on stderr (a resumed run; nothing when none of
    its work is done yet). The caller prints it on process 0 only."""
    if done > 0:
        print(f"resuming {done} of {total} {unit} done in {out}", file=sys.stderr, flush=True)
