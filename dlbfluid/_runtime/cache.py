"""The command line's persistent compilation cache (docs/cli.md, *Compilation cache*).

Every `dlbfluid` command compiles its programs for the shapes at hand; JAX's persistent
compilation cache keeps the compiled programs on disk, so that the second call of a
command with the same shapes loads them instead (the all-costs `equilibrium` of the
default scenario: 29 s cold, a few seconds warm). The command line turns it on by
default (`enable_from_environment`); the Python API leaves JAX's configuration to the user,
who turns the same cache on with one call, `dlbfluid.enable_compilation_cache()`.

Where: `$DLBFLUID_CACHE_DIR` if set (`off`, `0` or an empty value: no cache), else
JAX's own `$JAX_COMPILATION_CACHE_DIR` if set, else `$XDG_CACHE_HOME/dlbfluid/jax`
(`~/.cache/dlbfluid/jax` by default). A directory that cannot be created leaves the cache
off, with one line on stderr. The traced solvers are kept beside it (`exported`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

OFF = ("", "0", "off", "none", "false")

# Every program gets a disk entry: a warm `simulate default` otherwise compiled 87 small
# eager programs (under 0.1 s each) again, 2.4 s of its 7 s.
MIN_COMPILE_TIME_S = 0.0


def cache_dir(environ=None) -> Path | None:
    """The cache directory the command line uses (None: off), from the environment."""
    env = os.environ if environ is None else environ
    if "DLBFLUID_CACHE_DIR" in env:
        v = env["DLBFLUID_CACHE_DIR"].strip()
        return None if v.lower() in OFF else Path(v).expanduser()
    if env.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(env["JAX_COMPILATION_CACHE_DIR"]).expanduser()
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dlbfluid" / "jax"


def enable_compilation_cache(path: str | os.PathLike[str] | None = None) -> Path | None:
    """Keep compiled programs on disk, so that a new process loads them instead of compiling.

    JAX compiles each program for the shapes at hand in every new process; its persistent
    compilation cache stores the compiled programs in a directory and looks them up there
    first. The Python API leaves it off (it changes JAX's global configuration); this one
    call turns it on, with the command line's settings: every program is kept, however
    short its compile (`jax_persistent_cache_min_compile_time_secs = 0`). Call it once,
    after the imports and before the first computation. (docs/cli.md, *Compilation cache*.)

    **Arguments:**
    - `path`: the directory (created if missing). Default: the command line's,
      `$DLBFLUID_CACHE_DIR`, else `$JAX_COMPILATION_CACHE_DIR`, else
      `$XDG_CACHE_HOME/dlbfluid/jax` (`~/.cache/dlbfluid/jax`), so that the API and
      `dlbfluid` share their programs.

    **Returns:** the directory in use, or None when `path` is not given and
    `DLBFLUID_CACHE_DIR` says `off`.

    **Raises:** `ValueError` naming `path` when the directory cannot be created.
    """
    where = cache_dir() if path is None else Path(path).expanduser()
    if where is None:
        return None
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"path = {str(where)!r} is invalid: the directory cannot be created "
            f"({e.strerror or e}); expected a writable directory"
        ) from None
    _use(where, reopen=True)
    return where


def enable_from_environment(environ=None, stream=None) -> Path | None:
    """The command line's cache: JAX's persistent compilation cache at `cache_dir()`;
    returns it (None: off). A directory that cannot be created leaves the cache off, with
    one line on `stream` (stderr)."""
    path = cache_dir(environ)
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(
            f"dlbfluid: compilation cache off: cannot create {str(path)!r} ({e.strerror or e}); "
            "set DLBFLUID_CACHE_DIR to a writable directory or to 'off'",
            file=sys.stderr if stream is None else stream,
        )
        return None
    _use(path)
    return path


def _use(path: Path, *, reopen: bool = False) -> None:
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    if reopen and getattr(jax.config, "jax_compilation_cache_dir", None) != str(path):
        # JAX opens its cache once, at the first compile: a new directory needs it reopened.
        compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
