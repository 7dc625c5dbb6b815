"""The plots a newcomer reads (`dlbfluid._plot`): shared scales, mean latencies, equilibrium
lines and a single title in the trajectory figure; the experiment summary's legend, Rand
reference line and all-zero error panel. Synthetic inputs: nothing is simulated or
compiled."""

import types

import numpy as np
import pytest

from dlbfluid._plot import plot_summary, plot_trajectories, summary_figure, trajectory_figure
from dlbfluid._simulate import Solution

CELLS = ("a", "b", "c")


def fake_solution(policy: str, level: float, *, S: int = 40, T: float = 20.0) -> Solution:
    """An unbatched `Solution` whose workloads rise to `level * (1, 0.5, 0.25)`."""
    t = np.linspace(0.0, T, S + 1)
    shape = np.array([1.0, 0.5, 0.25])
    N = level * (1.0 - np.exp(-t))[:, None] * shape[None, :]
    rates = np.array([3.0, 2.0, 1.0])
    arrivals = t[:, None] * rates[None, :]
    work = np.concatenate([[0.0], np.cumsum(0.5 * (N[1:] + N[:-1]).sum(axis=1) * np.diff(t))])
    zeros = np.zeros((S + 1, 3))
    return Solution(
        t=t,
        N=N,
        x=np.broadcast_to(np.eye(3), (S + 1, 3, 3)).copy(),
        arrivals=arrivals,
        departures=arrivals,
        source_arrivals=arrivals,
        workload_integral=work,
        network_integral=0.1 * t,
        drops=zeros,
        in_flight=np.zeros(S + 1),
        status=np.asarray(0, np.int32),
        final_change=np.asarray(0.0),
        cell_mask=np.ones(3, bool),
        tick=np.asarray(T / S),
        policy=policy,
        cell_names=CELLS,
    )


def fake_equilibrium(cost: str, N) -> types.SimpleNamespace:
    return types.SimpleNamespace(cost=cost, N=np.asarray(N), z=np.array([3.0, 2.0, 1.0]))


def axes_of(fig, kind: str) -> dict:
    return {
        a.get_label().split(":", 1)[1]: a for a in fig.axes if a.get_label().startswith(kind + ":")
    }


def test_trajectory_panels_share_scales_and_show_latency_and_equilibria():
    sols = [
        fake_solution("disc-rif", 5.0),
        fake_solution("rand", 40.0),
        fake_solution("mnlb", 12.0),
    ]
    eq = fake_equilibrium("rif", [4.0, 45.0, 1.0])  # N* above every trajectory: in scale
    fig = trajectory_figure(sols, equilibria=[eq, None, None], window=0.25, ncols=2)
    work, route = axes_of(fig, "workload"), axes_of(fig, "routing")
    assert list(work) == list(route) == ["disc-rif", "rand", "mnlb"]
    assert len(fig.axes) == 6  # the unused fourth slot of the 2 x 2 grid is removed
    ylims = {a.get_ylim() for a in work.values()}
    assert len(ylims) == 1 and ylims.pop()[1] >= 45.0
    assert len({a.get_ylim() for a in route.values()}) == 1
    for sol in sols:
        title = work[sol.policy].get_title()
        assert sol.policy in title and f"{float(sol.mean_latency(0.25)):.3f} s" in title
    # Dashed lines at N*_j in the panel of the policy with an equilibrium, none elsewhere.
    flat = [ln for ln in work["disc-rif"].get_lines() if np.ptp(ln.get_ydata()) == 0]
    assert {4.0, 45.0, 1.0} <= {float(ln.get_ydata()[0]) for ln in flat}
    assert not [ln for ln in work["rand"].get_lines() if ln.get_linestyle() != "-"]
    assert "no cost" in work["rand"].get_title()
    assert_legend_clear(fig)


def assert_legend_clear(fig):
    """The figure's one legend overlaps no panel and not the title."""
    fig.draw_without_rendering()  # (runs the constrained layout)
    (legend,) = fig.legends
    box = legend.get_window_extent()
    for ax in fig.axes:
        assert not box.overlaps(ax.get_window_extent()), ax.get_label()
    if fig.get_suptitle():
        assert not box.overlaps(fig._suptitle.get_window_extent())


def test_single_trajectory_prints_its_title_once(tmp_path):
    sol = fake_solution("flow-grad", 10.0)
    fig = trajectory_figure(sol, title="three-cell: flow-grad")
    texts = [fig.get_suptitle()] + [a.get_title() for a in fig.axes]
    texts += [t.get_text() for leg in fig.legends for t in leg.get_texts()]
    assert sum(t.count("flow-grad") for t in texts) == 1
    assert fig.get_suptitle() == "three-cell: flow-grad"
    head = axes_of(fig, "workload")["flow-grad"].get_title()
    assert f"mean latency {float(sol.mean_latency()):.3f} s" in head
    assert_legend_clear(fig)
    # Without a title the policy names the figure, still once.
    fig = trajectory_figure(sol)
    texts = [fig.get_suptitle()] + [a.get_title() for a in fig.axes]
    assert sum(t.count("flow-grad") for t in texts) == 1
    path = plot_trajectories(sol, tmp_path / "sub" / "t.png", title="three-cell: flow-grad")
    assert path == tmp_path / "sub" / "t.png" and path.stat().st_size > 10_000


def test_trajectory_figure_rejects_bad_arguments():
    sol = fake_solution("rand", 1.0)
    with pytest.raises(ValueError, match="equilibria has 2 entries"):
        trajectory_figure([sol], equilibria=[None, None])
    with pytest.raises(ValueError, match="window"):
        trajectory_figure(sol, window=0.0)
    with pytest.raises(ValueError, match="at least one"):
        trajectory_figure([])


def summary_rows(errors: float, failed: int = 0) -> list[dict]:
    rows = []
    for v, scale in (("0.5", 0.9), ("0.9", 0.8)):
        for p, m in (("rand", 1.0), ("flow-grad", scale), ("mnlb", 1.3)):
            rows.append(
                {
                    "variant": v,
                    "policy": p,
                    "runs": 4,
                    "failed": failed if p == "mnlb" else 0,
                    "normalized_latency": m,
                    "normalized_latency_p10": m - 0.05 * (p != "rand"),
                    "normalized_latency_p50": m,
                    "normalized_latency_p90": m + 0.05 * (p != "rand"),
                    "mean_latency": 2.0 * m,
                    "error_rate": errors if p != "rand" else 0.0,
                    "error_rate_p90": 2 * errors if p != "rand" else 0.0,
                }
            )
    return rows


def test_summary_all_zero_errors_and_legend_outside(tmp_path):
    fig = summary_figure(summary_rows(0.0), "utilisation")
    lat = next(a for a in fig.axes if a.get_label() == "latency")
    err = next(a for a in fig.axes if a.get_label() == "errors")
    assert err.get_ylim() == (0.0, 0.1)  # not matplotlib's -0.04..0.04
    assert any("no dropped requests" in t.get_text() for t in err.texts)
    lo, hi = lat.get_ylim()
    assert lo <= 0.75 and hi >= 1.35  # every 10-90% bar and the Rand line are in view
    assert any(np.allclose(ln.get_ydata(), 1.0) for ln in lat.get_lines())  # Rand = 1
    # One legend, outside both panels, so it covers no marker or error bar.
    assert lat.get_legend() is None and err.get_legend() is None and len(fig.legends) == 1
    fig.draw_without_rendering()  # (runs the constrained layout)
    box = fig.legends[0].get_window_extent()
    for ax in (lat, err):
        assert not box.overlaps(ax.get_window_extent())
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["rand", "flow-grad", "mnlb", "Rand = 1"]
    plot_summary(summary_rows(0.0), tmp_path / "s.png", title="utilisation")
    assert (tmp_path / "s.png").stat().st_size > 10_000


def test_summary_error_axis_fits_the_data_and_failures_are_listed():
    fig = summary_figure(summary_rows(0.02, failed=1))
    err = next(a for a in fig.axes if a.get_label() == "errors")
    assert err.get_ylim()[0] == 0.0 and err.get_ylim()[1] >= 4.0  # p90 = 4% in view
    assert not err.texts
    assert "mnlb at 0.5: 1 of 4" in fig.get_supxlabel()
