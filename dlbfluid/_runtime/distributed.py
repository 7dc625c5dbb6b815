"""One run shared by several processes and hosts, on JAX's multi-process runtime.

A run across `P` processes is the same command started once per process (one per host,
or one per accelerator), each with `--coordinator HOST:PORT --num-processes P
--process-id I` or the environment variables `JAX_COORDINATOR_ADDRESS`,
`JAX_NUM_PROCESSES`, `JAX_PROCESS_ID` (docs/cli.md, *On a cluster*). `start` validates these
before any work and initialises `jax.distributed`; process 0 hosts the coordinator.

**Design.** Every process computes its own share of the scenarios on its own devices
only (`jax.local_devices()`: `dlbfluid._runtime.devices` shards a batch over those), and the
processes exchange host-side results only, JSON-encoded, through the coordinator's
key-value store (`Processes.gather`, `broadcast`, `allgather`). No array spans
processes, so no cross-process collective ever runs: nothing depends on CPU collectives
(gloo or MPI) or on XLA's collective timeouts, a process may wait as long as a slower one
needs, and JSON carries every float64 exactly. Scenario `i` is drawn from `(seed, i)` alone, shares are contiguous
(`Processes.share`, the same split on every process), and the work is split so that
each scenario is computed as in a one-process run (`verify`: its chunks, a round of
`P` chunks at a time; `run_experiment`: the scenarios of each `(variant, policy)` batch,
with the batch-wide choices made on the whole batch). Process 0 alone reads and writes
the output directory, merges the shares in index order (so its files and `--json` output
are a one-process run's) and prints; the other processes print and write nothing.

Every process makes the same sequence of exchanges (each names its step, `tag`, and a
mismatch is an error rather than a silent mix of results). A process that fails tells
the others (`Processes.abort`, called by the command line), which then stop with an
error; one that dies is detected by the coordinator's heartbeats, which stop the others.
Every process then exits with process 0's status (`Processes.finish`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from typing import Any

# How long one exchange waits for the other processes (ms): as long as any share can take.
# (A process that dies is detected by the coordinator's heartbeats, which end the wait.)
_WAIT_MS = 7 * 24 * 3600 * 1000

_OPTIONS = (
    ("coordinator", "--coordinator", "JAX_COORDINATOR_ADDRESS"),
    ("num_processes", "--num-processes", "JAX_NUM_PROCESSES"),
    ("process_id", "--process-id", "JAX_PROCESS_ID"),
)
_ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9._-]*):([0-9]{1,5})$")


@dataclasses.dataclass(eq=False)
class Processes:
    """The processes sharing one run: `count` of them, this one number `index`.

    `Processes()` is a run on this process alone: `share(n)` is all of `range(n)` and
    the exchanges return their argument, so code written for several processes runs
    unchanged (and as fast) on one.
    """

    count: int = 1
    index: int = 0
    _client: Any = dataclasses.field(default=None, repr=False)
    _step: int = dataclasses.field(default=0, repr=False)

    @property
    def main(self) -> bool:
        """Process 0: the one that reads and writes the output and prints."""
        return self.index == 0

    def share(self, n: int) -> range:
        """This process's contiguous part of `range(n)`, the same split on every process:
        the first `n % count` processes take one item more (a process may get none)."""
        q, r = divmod(int(n), self.count)
        lo = self.index * q + min(self.index, r)
        return range(lo, lo + q + (1 if self.index < r else 0))

    def gather(self, obj, tag: str) -> list | None:
        """Every process's `obj` (JSON-serialisable), in process order, on process 0;
        `None` on the others (which return once process 0 has them all)."""
        out = self._exchange(obj, tag, "none")
        return out if self.main else None

    def broadcast(self, obj, tag: str):
        """Process 0's `obj` on every process (the others' `obj` is ignored)."""
        return self._exchange(obj if self.main else None, tag, "main")

    def allgather(self, obj, tag: str) -> list:
        """Every process's `obj`, in process order, on every process."""
        return self._exchange(obj, tag, "all")

    def finish(self, code: int) -> int:
        """Process 0's exit code, on every process once every process has finished (so
        that no process leaves while process 0 still works: JAX's shutdown would fail)."""
        return int(self.broadcast(int(code), "finish"))

    def abort(self, message: str) -> None:
        """Tell the other processes that this one failed: each stops with an error at its
        current or next exchange instead of waiting for this one."""
        if self.count == 1:
            return
        key = f"dlbfluid/{self._step}/{'reply' if self.main else self.index}"
        try:
            self._client.key_value_set(
                key, json.dumps(["abort", f"{self.index} failed: {message}"])
            )
        except Exception:  # noqa: BLE001 - this step's value was sent already: it will do
            pass

    def _exchange(self, obj, tag: str, reply: str):
        if self.count == 1:
            return [obj] if reply in ("none", "all") else obj
        client = self._client
        step = self._step  # (advanced once the exchange is complete, for `abort`)
        base = f"dlbfluid/{step}"
        if not self.main:
            client.key_value_set(f"{base}/{self.index}", json.dumps([tag, obj]))
            answer = _checked(client.blocking_key_value_get(f"{base}/reply", _WAIT_MS), tag, 0)
            self._step = step + 1
            return answer
        values = [json.loads(json.dumps(obj))]
        for p in range(1, self.count):
            values.append(_checked(client.blocking_key_value_get(f"{base}/{p}", _WAIT_MS), tag, p))
            client.key_value_delete(f"{base}/{p}")
        answer = {"none": None, "all": values, "main": values[0]}[reply]
        client.key_value_set(f"{base}/reply", json.dumps([tag, answer]))
        if step >= 2:  # read by every process: each has sent its value of the next step
            client.key_value_delete(f"dlbfluid/{step - 2}/reply")
        self._step = step + 1
        return values if reply in ("none", "all") else values[0]


def _checked(text: str, tag: str, process: int):
    got, value = json.loads(text)
    if got == "abort":
        raise RuntimeError(f"stopped because process {value}")
    if got != tag:
        raise RuntimeError(
            f"process {process} is at step {got!r} where this process is at {tag!r}: "
            "every process must run the same command with the same options"
        )
    return value


_CURRENT: Processes | None = None


def resolve(
    coordinator=None,
    num_processes=None,
    process_id=None,
    *,
    detect: bool = False,
    environ: Mapping[str, str] | None = None,
) -> dict | None:
    """The validated settings of a run across processes, or `None` for one process.

    Each of `coordinator` (`"HOST:PORT"`), `num_processes` and `process_id` (integers, or
    their text) comes from the argument, else from `JAX_COORDINATOR_ADDRESS`,
    `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID` in `environ` (default `os.environ`). All three
    or none must be given, unless `detect` lets JAX's cluster detection (SLURM, Open MPI,
    Kubernetes, Cloud TPU) supply the rest. One process (`num_processes` 1) needs no
    coordinator: `None`. Raises `ValueError` naming the option, its value and what is
    allowed.
    """
    env = os.environ if environ is None else environ
    given: dict = {}
    source: dict = {}
    args = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    for key, flag, var in _OPTIONS:
        value = args[key]
        if value is None and env.get(var) not in (None, ""):
            value, flag = env[var], var
        if value is not None:
            given[key], source[key] = value, flag
    if not given and not detect:
        return None
    if "coordinator" in given:
        text = str(given["coordinator"]).strip()
        m = _ADDRESS.match(text)
        if m is None or not 1 <= int(m.group(2)) <= 65535:
            raise ValueError(
                f"{source['coordinator']} = {given['coordinator']!r} is invalid: expected "
                "HOST:PORT, process 0's host name or address and a free port in [1, 65535] "
                "(e.g. 10.0.0.1:12355)"
            )
        given["coordinator"] = text
    if "num_processes" in given:
        given["num_processes"] = _integer(given["num_processes"], source["num_processes"], 1)
    if "process_id" in given:
        P = given.get("num_processes")
        bound = None if P is None else f"{source['num_processes']} = {P}"
        given["process_id"] = _integer(given["process_id"], source["process_id"], 0, P, bound)
    missing = [k for k, _, _ in _OPTIONS if k not in given]
    if missing and not detect:
        name = {k: f"{flag} (or {var})" for k, flag, var in _OPTIONS}
        raise ValueError(
            f"{', '.join(source[k] for k in given)} given without "
            f"{' and '.join(name[k] for k in missing)}: a run across processes needs all "
            "three of --coordinator, --num-processes and --process-id, or --detect-cluster "
            "to let JAX's cluster detection find the rest"
        )
    if not missing and given["num_processes"] == 1:
        return None
    return {"coordinator": None, "num_processes": None, "process_id": None, **given}


def _integer(value, name: str, lo: int, hi: int | None = None, bound: str | None = None) -> int:
    try:
        v = None if isinstance(value, bool) else int(str(value).strip())
    except ValueError:
        v = None
    if v is None or v < lo or (hi is not None and v >= hi):
        allowed = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}) ({bound})"
        shown = v if v is not None else repr(value)
        raise ValueError(f"{name} = {shown} is invalid: expected {allowed}")
    return v


def start(
    coordinator=None,
    num_processes=None,
    process_id=None,
    *,
    detect: bool = False,
    environ: Mapping[str, str] | None = None,
) -> Processes:
    """The processes of this run, `jax.distributed` initialised for them (`resolve` gives
    the arguments; `Processes()` for one process, which initialises nothing).

    Call before any JAX computation. Every process then starts its JAX backend and they
    check that each has as many devices of one platform (so that every share is computed
    as a one-process run on such a machine would). Calling it again in the same
    process (or after the user's own `jax.distributed.initialize`) reuses the runtime.
    """
    global _CURRENT
    settings = resolve(coordinator, num_processes, process_id, detect=detect, environ=environ)
    if settings is None:
        return Processes()
    import jax
    from jax._src import distributed as _runtime  # the key-value store's client

    if _CURRENT is None:
        if not jax.distributed.is_initialized():
            # (JAX's cluster detection fills in only what is not given: with all three
            # options, at most the local device ids, e.g. one GPU per SLURM task.)
            jax.distributed.initialize(
                settings["coordinator"], settings["num_processes"], settings["process_id"]
            )
        procs = Processes(jax.process_count(), jax.process_index(), _runtime.global_state.client)
        found = procs.allgather([jax.local_device_count(), jax.default_backend()], "start")
        if any(f != found[0] for f in found):
            raise ValueError(
                f"devices per process = {found} ([count, platform] of each) are invalid: "
                "every process must have as many devices of one platform"
            )
        _CURRENT = procs
    for key, value in (("num_processes", _CURRENT.count), ("process_id", _CURRENT.index)):
        if settings[key] is not None and settings[key] != value:
            raise ValueError(
                f"{key} = {settings[key]} is invalid: this process already runs as process "
                f"{_CURRENT.index} of {_CURRENT.count}"
            )
    return _CURRENT
