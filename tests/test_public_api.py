"""Pin the public import surface."""

import dlbfluid

EXPECTED = {
    "Accurate", "AbstractPolicy", "DiscreteRouting", "Fast", "FlowRouting", "OverloadError",
    "POLICY_NAMES", "STATUS", "Scenario", "ScenarioError", "ServiceModel", "SimulationError",
    "Solution", "WeightedRandom", "arc_cost", "check_capacity", "default_scenario",
    "destination_cost", "load_scenario", "pad_scenario", "policy_from_name", "project_simplex",
    "route_costs", "scenario_from_dict", "scenario_to_dict", "simulate", "stack_scenarios",
    "weighted_random_routing", "Diagnostics", "fit_theorem1", "lyapunov_diagnostics",
    "workload_gap", "workload_potential", "HerdingResult", "StabilityResult",
    "characteristic_roots", "critical_step_size", "herding", "linearise", "spectral_abscissa",
    "symmetric_critical_step_size", "random_network", "verify", "EQ_STATUS",
    "EquilibriumError", "EquilibriumSolution", "price_of_anarchy", "solve_equilibrium",
    "equilibrium_sensitivities", "ErrorAversion", "ExperimentConfig", "run_experiment",
    "GeneratedScenarios", "generate", "scenario_dicts", "MNLB", "FitInfo", "fit_latency_model",
    "perturb_service", "sample_latency", "MNLB_STATUS", "MNLBInfo", "mnlb_weights",
    "rif_latency_range", "step_size_ratio", "ProjectionCheck", "projection_check", "fit_bound",
    "Theorem1Check", "Theorem1Constants", "THEOREM1_ESTIMATES", "theorem1_check", "theorem1_constants",
    "BatchStability", "batch_critical_step_size",
    "simulate_requests", "RequestSolution", "ServerCells", "Workload", "OnlineEstimation",
    "EstimationReport",
}


def test_public_surface():
    public = {n for n in dir(dlbfluid) if not n.startswith("_")}
    missing = EXPECTED - public
    assert not missing, missing
