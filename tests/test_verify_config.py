"""`VerifyConfig`: verify's settings as one object (issue 31 item 5), checked when made;
keywords replace its fields; the manifest records what changes a number. Nothing here
compiles."""

import dataclasses

import pytest

import dlbfluid as dl
from dlbfluid._verify.verb import _config


@pytest.mark.parametrize(
    "field, value, shown",
    [
        ("generator", "grid", "generator = 'grid' is invalid: allowed values are ['random'"),
        ("step_base", "eta1", "step_base = 'eta1' is invalid"),
        ("ladder", "half", "ladder = 'half' is invalid"),
        ("tau_scales", (0.0,), "tau_scales = (0.0,) is invalid: expected scales > 0"),
        ("chunk", 0, "chunk = 0 is invalid: expected an integer >= 1"),
        ("starts", True, "starts = True is invalid"),
        ("step_fraction", -0.1, "step_fraction = -0.1 is invalid: expected a finite number > 0"),
        ("horizon", 1.0, "horizon = 1.0 is invalid: expected a whole number of ticks of 0.3"),
    ],
)
def test_bad_fields_name_the_field_the_value_and_what_is_allowed(field, value, shown):
    extra = {"tick": 0.3} if field == "horizon" else {}
    with pytest.raises(ValueError) as e:
        dl.VerifyConfig(**{field: value}, **extra)
    assert shown in str(e.value)


def test_keywords_replace_the_config_and_unknown_ones_are_refused():
    base = dl.VerifyConfig(step_base="eta0", step_fraction=1.0, tau_scales=(2.0,))
    assert base.tau_scales == (1.0, 2.0)  # 1 is always included
    cfg = _config(base, {"horizon": 100.0, "policies": ["flow-grad"]})
    assert cfg == dataclasses.replace(base, horizon=100.0, policies=("flow-grad",))
    assert cfg.ticks == 20000 and cfg.step_base == "eta0"  # 100 s at the 5 ms default tick
    assert _config(None, {}) == dl.VerifyConfig()
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['horizn'\]"):
        dl.verify(1, horizn=10.0)
    with pytest.raises(ValueError, match="config = 3 is invalid: expected a VerifyConfig"):
        dl.verify(1, config=3)


def test_the_manifest_records_only_changed_later_settings():
    """A run with the defaults keeps the manifest it always had; settings added later
    appear only where they differ from their defaults."""
    plain = dl.VerifyConfig().manifest(8, 0)
    assert set(plain) == {"n_scenarios", "seed", "n_cells", "horizon", "tick", "step_fraction",
                          "conv_tol", "nodes", "policies", "draw"}  # fmt: skip
    assert plain["policies"] == ["flow-rif", "flow-lat", "flow-grad"]
    m = dl.VerifyConfig(step_base="eta0", worst_case=True, starts=4).manifest(8, 0)
    assert m["step_base"] == "eta0" and m["worst_case"] is True and m["starts"] == 4
    assert m["search_range"] == [0.25, 1.1] and m["bracket_tol"] == 0.01
    assert "ladder" not in m and "tau_scales" not in m


def test_a_refused_field_is_named_by_its_option_only_through_the_cli():
    """`VerifyConfig` names the field (`tick = 0.0`); `dlbfluid verify` relabels the
    same refusal with its option (`--tick = 0.0`), from its table in `dlbfluid._cli._flags`
    (the library holds no option names)."""
    from dlbfluid._cli import build_parser
    from dlbfluid._cli._verify import _config as cli_config

    with pytest.raises(ValueError) as e:
        dl.VerifyConfig(tick=0.0)
    assert str(e.value).startswith("tick = 0.0 is invalid: expected a finite number > 0")
    args = build_parser().parse_args(["verify"])
    # control: the defaults pass (the option's default tick is the paper's probe cadence)
    assert cli_config(args) == dataclasses.replace(dl.VerifyConfig(), tick=args.tick)
    args.tick = 0.0  # (a value the option's own check would refuse first)
    with pytest.raises(ValueError) as e:
        cli_config(args)
    assert str(e.value).startswith("--tick = 0.0 is invalid: expected a finite number > 0")
    args.tick, args.starts = 0.005, 0
    with pytest.raises(ValueError, match=r"^--starts = 0 is invalid: expected an integer >= 1"):
        cli_config(args)
