"""Traced programs kept on disk for the command line (docs/cli.md, *Compilation cache*).

JAX's persistent compilation cache (`cache`) saves the XLA compilation of a program, but
every process still traces the Python code into a program first, and for the solvers'
nested, vmapped convergence loops the tracing takes longer than loading the compiled
code: about 2 s of the 2.5 s a warm `dlbfluid equilibrium` spends per cost. Inside a
command-line call (`exporting`), the big solvers are therefore traced once and kept as
`jax.export` artefacts next to the compilation cache; a later call with the same shapes,
static configuration, versions and package source deserialises the program, and its compilation is then
a persistent-cache hit.

Only the command line turns this on, for the length of one call: the Python API traces as
usual (users, and the tests that count traces, see no difference). It is used with one
process on one device, for programs without host callbacks, and for static
configurations whose `repr` is stable across processes (a user's extension holding a
function is not, and is traced as usual). Anything that fails to export, load or save
falls back to the plain call: the artefacts are a cache, never needed for a result.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax
import jaxlib

import dlbfluid

_DIR: list[Path | None] = [None]
_LOADED: dict[str, Callable] = {}  # key -> jitted call of the deserialised program
# A repr holding a memory address ("<function f at 0x7f...>") differs in every process.
_UNSTABLE = re.compile(r" at 0x[0-9a-f]+")


@contextlib.contextmanager
def exporting(directory: Path | None):
    """Keep traced programs under `directory / "exported"` inside this block (None: off)."""
    saved = _DIR[0]
    _DIR[0] = None if directory is None else Path(directory) / "exported"
    try:
        yield
    finally:
        _DIR[0] = saved


@functools.cache
def _source_digest() -> str:
    """A digest of the package's Python source: the version string alone does not change
    between the commits of a git checkout or the edits of an editable install, and a
    program traced from other code must not be reused."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _key(name: str, static, leaves, treedef) -> str | None:
    text = repr(static)
    if _UNSTABLE.search(text):
        return None
    dev = jax.local_devices()[0]
    parts = (
        name,
        text,
        str(treedef),
        tuple((tuple(a.shape), str(a.dtype)) for a in leaves),
        dlbfluid.__version__,
        _source_digest(),
        jax.__version__,
        jaxlib.__version__,
        bool(jax.config.read("jax_enable_x64")),
        dev.platform,
        getattr(dev, "device_kind", ""),
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:40]


def call(name: str, fn, args: tuple, static, *, trace=None, compiler_options=None):
    """`fn(*args)`, through a kept `jax.export` artefact when `exporting` is on.

    `fn` is a function of the array pytrees `args` alone (its static configuration bound,
    and described by `static`, whose `repr` enters the key with the shapes, dtypes, tree
    structure and versions); its outputs must be arrays in containers JAX serialises
    (tuples, lists, dicts). `trace` is the same function before `jit` (one built with
    `compiler_options` cannot be nested), exported and then compiled with those options.
    """
    directory = _DIR[0]
    if directory is None or jax.process_count() > 1 or jax.local_device_count() > 1:
        return fn(*args)
    leaves, treedef = jax.tree_util.tree_flatten(args)
    if not all(_concrete_array(a) for a in leaves):  # under an outer jit, or not arrays
        return fn(*args)
    key = _key(name, static, leaves, treedef)
    if key is None:
        return fn(*args)
    run = _LOADED.get(key)
    if run is None:
        path = directory / f"{name}-{key}.jaxexport"
        exp = _load(path)
        if exp is None:
            exp = _export(fn if trace is None else trace, treedef, leaves)
            if exp is None:
                return fn(*args)
            _save(path, exp)
        run = _LOADED[key] = jax.jit(exp.call, compiler_options=compiler_options or {})
    return run(*leaves)


def _concrete_array(a) -> bool:
    return hasattr(a, "shape") and hasattr(a, "dtype") and not isinstance(a, jax.core.Tracer)


def _export(fn, treedef, leaves):
    def flat(*xs):
        return fn(*jax.tree_util.tree_unflatten(treedef, xs))

    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in leaves]
    try:
        return jax.export.export(jax.jit(flat))(*specs)
    except Exception:  # noqa: BLE001 - not exportable (a callback, a custom call): trace
        return None


def _load(path: Path):
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        return jax.export.deserialize(bytearray(data))
    except Exception:  # noqa: BLE001 - a torn or foreign file: trace again, overwrite it
        return None


def _save(path: Path, exp) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(exp.serialize())
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new
    except Exception:  # noqa: BLE001 - a read-only or full disk: keep the traced program
        pass
