"""The command-line option of each field a verb's library call names, one table per verb.

The library names its arguments and configuration fields in its errors (`scenarios = 0 is
invalid: ...`), as a Python caller wrote them; the command line says the option the user
typed instead (`--scenarios = 0 is invalid: ...`). Each verb's correspondence lives here,
once, and nowhere in the library: the commands relabel the library's messages with
`relabel`, and the resumable commands give the same table to the library call (`verify`,
`run_experiment`: `labels=`), which hands it to the output directory's manifest
(`dlbfluid._runtime.manifest`) so that a changed setting is named by its option
(`seed (--seed): 0 -> 1`) and the directory by `--out` (its `"out_dir"` entry).
"""

from __future__ import annotations

from collections.abc import Mapping

SIMULATE_REQUESTS = {
    "service": "--service",
    "leaf": "--leaf",
    "probe_smoothing": "--probe-smoothing",
    "estimation": "--estimation",
    "refit_period": "--refit-period",
    "probing": "--mitigation",
    "affinity": "--affinity",
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
    "out_dir": "--out",
    "experiment": "KIND",
    "scenarios": "--scenarios",
    "trials": "--trials",
    "seed": "--seed",
    "horizon": "--horizon",
    "tick": "--tick",
    "step_rule": "--step-rule",
    "step_fraction": "--step-fraction",
    "policies": "--policies",
    "variants": "--variants",
    "error_aversion": "--no-error-aversion",
    "mnlb_error_aversion": "--mnlb-error-aversion",
    "model": "--model",
    "service": "--service",
    "scale": "--scale",
    "probe_smoothing": "--probe-smoothing",
    "leaf": "--leaf",
    "pod_d": "--pod-d",
    "estimation": "--estimation",
    "refit_period": "--refit-period",
    "estimation_window": "--estimation-window",
    "mitigation": "--mitigation",
    "probing": "--mitigation",
    "shrinkage": "--mitigation",
    "dithering": "--mitigation",
}
"""`ExperimentConfig`'s fields (and its manifest's) and the options of `dlbfluid experiment`."""

VERIFY = {
    "out_dir": "--out",
    "n_scenarios": "--scenarios",
    "seed": "--seed",
    "n_cells": "--min-cells, --max-cells",
    "horizon": "--horizon",
    "tick": "--tick",
    "step_fraction": "--step-fraction",
    "conv_tol": "--conv-tol",
    "generator": "--generator",
    "scenario": "--scenario",
    "step_rule": "--step-rule",
    "ladder": "--ladder",
    "tau_scales": "--tau-scales",
    "policies": "--policy",
    "step_base": "--step-base",
    "worst_case": "--worst-case",
    "starts": "--starts",
    "search_range": "--search-range",
    "bracket_tol": "--bracket-tol",
    "chunk": "--chunk",
}
"""`verify`'s arguments, `VerifyConfig`'s fields (and its manifest's) and the options of
`dlbfluid verify`."""


def relabel(error: Exception, table: Mapping[str, str]) -> ValueError:
    """`error`'s message with its leading field name (`field = ...`, `field: ...`) replaced
    by the field's option in `table`; unchanged when the message starts otherwise."""
    msg = str(error)
    field = msg.split(" ", 1)[0].rstrip(":")
    if field in table:
        msg = table[field] + msg[len(field) :]
    return ValueError(msg)
