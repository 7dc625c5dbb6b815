"""Scenario parsing: every bad input of the file format gets a clear error."""

import copy
import json

import numpy as np
import pytest
from helpers import THREE, three

import dlbfluid as dl


def test_example_from_issue_parses():
    d = {"name": "example",
         "cells": [{"name": "us-east", "arrival_rate": 3.0, "replicas": 4,
                    "service": {"model": "softplus", "base_latency": 1.0, "capacity": 6.0,
                                "knee": 3.0, "width": 1.0}},
                   {"name": "eu-west", "arrival_rate": 1.0, "replicas": 2,
                    "service": {"model": "mm1", "capacity": 3.0}}],
         "latency": [[0.0, 0.04], [0.04, 0.0]]}
    s = dl.scenario_from_dict(d)
    assert s.cell_names == ("us-east", "eu-west")
    # default routing: weighted random by replicas over allowed arcs
    np.testing.assert_allclose(s.initial_routing, [[4 / 6, 2 / 6], [4 / 6, 2 / 6]])
    np.testing.assert_allclose(s.initial_workload, [0.0, 0.0])
    back = dl.scenario_from_dict(dl.scenario_to_dict(s))
    np.testing.assert_array_equal(back.latency, s.latency)


def _bad(mutate):
    d = copy.deepcopy(THREE)
    mutate(d)
    return d


CASES = [
    (lambda d: d["cells"][0].__setitem__("arrival_rate", -1.0), ["cells[0].arrival_rate", "-1.0", ">= 0"]),
    (lambda d: d["cells"][0].__setitem__("arrival_rate", float("nan")), ["cells[0].arrival_rate", "finite"]),
    (lambda d: d["cells"][1]["service"].__setitem__("capacity", 0.0), ["cells[1].service.capacity", "> 0"]),
    (lambda d: d["cells"][2]["service"].__setitem__("capacity", float("inf")), ["cells[2].service.capacity", "finite"]),
    (lambda d: d["cells"][0]["service"].__setitem__("width", -0.5), ["cells[0].service.width", "-0.5", "> 0"]),
    (lambda d: d["latency"][0].__setitem__(1, -0.01), ["latency[0][1]", "-0.01", ">= 0"]),
    (lambda d: d["latency"][2].__setitem__(0, float("inf")), ["latency[2][0]", "finite"]),
    (lambda d: d.__setitem__("latency", [[0.0, 0.1], [0.1, 0.0]]), ["latency", "3 x 3"]),
    (lambda d: d["latency"][1].pop(), ["latency", "3 x 3"]),
    (lambda d: d["cells"][1]["service"].__setitem__("model", "gg1"), ["cells[1].service.model", "gg1", "mm1", "softplus"]),
    (lambda d: d["cells"][0].__setitem__("replicas", 0), ["cells[0].replicas", "integer >= 1"]),
    (lambda d: d.__setitem__("latency", [[0.0, None, None], [0.03, 0.0, 0.07], [0.11, 0.07, 0.0]])
     or d["latency"][0].__setitem__(0, None), ["cells[0]", "no arc"]),
    (lambda d: d["cells"][0]["service"].update(knee=5.0), ["a0", "not monotone"]),
    (lambda d: d["cells"][0]["service"].update(knee=4.0), ["a0", "exponentially"]),
    (lambda d: d["cells"][0].__setitem__("arrival_rate", {"times": [0, 1], "rates": [1.0]}),
     ["cells[0].arrival_rate", "'times' has 2 entries"]),
    (lambda d: d["cells"][0].__setitem__("arrival_rate", {"times": [2, 1], "rates": [1.0, 1.0]}),
     ["cells[0].arrival_rate.times", "non-decreasing"]),
    (lambda d: d.__setitem__("initial", {"routing": [[0.5, 0.6, 0], [0, 1, 0], [0, 0, 1]]}),
     ["initial.routing[0]", "sum to 1"]),
    (lambda d: d.__setitem__("initial", {"workload": [0, -1, 0]}), ["initial.workload[1]", ">= 0"]),
    (lambda d: d["cells"][0].__setitem__("colour", "red"), ["cells[0]", "colour", "unknown"]),
]


@pytest.mark.parametrize("mutate,needles", CASES)
def test_bad_input_raises_clear_error(mutate, needles):
    with pytest.raises(dl.ScenarioError) as e:
        dl.scenario_from_dict(_bad(mutate))
    msg = str(e.value)
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_overload_names_cells_and_sources():
    # Cell b may only serve itself, and its demand exceeds its capacity.
    d = three()
    d["cells"][1]["arrival_rate"] = 3.5
    d["latency"][1] = [None, 0.0, None]
    with pytest.raises(dl.OverloadError) as e:
        dl.scenario_from_dict(d)
    assert e.value.cells == ["b"] and e.value.sources == ["b"]
    assert e.value.demand == pytest.approx(3.5) and e.value.capacity == pytest.approx(3.0)
    assert "'b'" in str(e.value) and "allow_overload" in str(e.value)
    # Total demand above total capacity: every cell is in the cut.
    d = three()
    for c in d["cells"]:
        c["arrival_rate"] = 4.0
    with pytest.raises(dl.OverloadError) as e:
        dl.scenario_from_dict(d)
    assert sorted(e.value.cells) == ["a", "b", "c"]
    # Demand exactly at capacity is not strictly feasible either (Assumption 2).
    d = three()
    d["cells"][1]["arrival_rate"] = 3.0
    d["latency"][1] = [None, 0.0, None]
    with pytest.raises(dl.OverloadError):
        dl.scenario_from_dict(d)
    # Asked for explicitly, overload is allowed.
    d["cells"][1]["arrival_rate"] = 3.5
    s = dl.scenario_from_dict(d, allow_overload=True)
    assert float(s.arrival_rate(0.0)[1]) == 3.5


def test_overload_checked_at_profile_peaks():
    d = three()
    d["cells"][0]["arrival_rate"] = {"times": [0, 10, 20], "rates": [2.0, 9.0, 2.0]}
    with pytest.raises(dl.OverloadError) as e:
        dl.scenario_from_dict(d)
    assert "t = 10" in str(e.value)


def test_piecewise_constant_profile():
    d = three()
    d["cells"][0]["arrival_rate"] = {"kind": "piecewise_constant", "times": [0, 5], "rates": [1.0, 2.0]}
    s = dl.scenario_from_dict(d)
    np.testing.assert_allclose(s.arrival_rate(4.999)[0], 1.0)
    np.testing.assert_allclose(s.arrival_rate(5.001)[0], 2.0)


def test_load_scenario_file_errors(tmp_path):
    p = tmp_path / "s.json"
    p.write_text("{not json")
    with pytest.raises(dl.ScenarioError, match="not valid JSON"):
        dl.load_scenario(p)
    with pytest.raises(dl.ScenarioError, match="cannot be read"):
        dl.load_scenario(tmp_path / "missing.json")
    p.write_text(json.dumps(THREE))
    assert dl.load_scenario(p).n_cells == 3


def test_padding_and_stacking():
    a = dl.scenario_from_dict(THREE)
    b = dl.default_scenario()
    batch = dl.stack_scenarios([a, b])
    assert batch.replicas.shape == (2, 4)
    assert batch.cell_mask.tolist() == [[True, True, True, False], [True] * 4]
    assert not bool(batch.allowed[0, 3].any()) and not bool(batch.allowed[0, :, 3].any())
    assert float(batch.arrival_rates[0, 3].max()) == 0.0
