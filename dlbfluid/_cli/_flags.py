"""The command-line option of each field a verb's library call names, one table per verb.

The library names its arguments and configuration fields in its errors (`scenarios = 0 is
invalid: ...`), as a Python caller wrote them; the command line says the option the user
typed instead (`--scenarios = 0 is invalid: ...`). Each verb's correspondence lives here,
once: the commands relabel the library's messages with `relabel`, and the resumable
commands give the same table to the output directory's manifest (`dlbfluid._runtime.manifest`,
`labels=`) so that a changed setting is named by its option.
"""

from __future__ import annotations

from collections.abc import Mapping

SIMULATE_REQUESTS = {
    "service": "--service",
    "scale": "--scale",
    "trials": "--trials",
    "seed": "--seed",
    "horizon": "--horizon",
    "tick": "--tick",
    "warmup": "--window",
    "n_save": "--n-save",
    "step_size": "--step-size",
}
"""`simulate_requests`' arguments and the options of `dlbfluid simulate --model requests`."""

EXPERIMENT = {
    "experiment": "KIND",
    "scenarios": "--scenarios",
    "trials": "--trials",
    "seed": "--seed",
    "horizon": "--horizon",
    "tick": "--tick",
    "step_rule": "--step-rule",
    "step_fraction": "--step-fraction",
    "policies": "--policies",
    "error_aversion": "--no-error-aversion",
    "mnlb_error_aversion": "--mnlb-error-aversion",
    "model": "--model",
    "service": "--service",
}
"""`ExperimentConfig`'s fields (and its manifest's) and the options of `dlbfluid experiment`."""


def relabel(error: Exception, table: Mapping[str, str]) -> ValueError:
    """`error`'s message with its leading field name (`field = ...`, `field: ...`) replaced
    by the field's option in `table`; unchanged when the message starts otherwise."""
    msg = str(error)
    field = msg.split(" ", 1)[0].rstrip(":")
    if field in table:
        msg = table[field] + msg[len(field) :]
    return ValueError(msg)
