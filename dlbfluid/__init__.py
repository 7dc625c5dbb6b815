"""dlbfluid: the DLB fluid model of distributed load balancing, in JAX.

Importing dlbfluid changes no global configuration. float64, the default for
verification, needs JAX's x64 mode: call `dlbfluid.enable_x64()` (or
`jax.config.update("jax_enable_x64", True)`) first, or a verb asked for float64 raises
(`dlbfluid._precision`); `dtype=jnp.float32` gives `simulate` throughput. The command line
enables x64 itself.

`import dlbfluid` itself imports no JAX, so that the command line's `--help` answers at
once: the public names are loaded on first use (PEP 562). The imports in the
`TYPE_CHECKING` block below are the one list of them: type checkers read them, and
`__getattr__` reads the same block to know where each name lives.
"""

from typing import TYPE_CHECKING

__version__ = "0.2.0"

if TYPE_CHECKING:
    from ._costs import RIF as RIF
    from ._costs import AbstractCost as AbstractCost
    from ._costs import Gradient as Gradient
    from ._costs import Latency as Latency
    from ._costs import arc_cost as arc_cost
    from ._costs import cost_from_name as cost_from_name
    from ._costs import destination_cost as destination_cost
    from ._costs import route_costs as route_costs
    from ._equilibrium import EQ_STATUS as EQ_STATUS
    from ._equilibrium import EquilibriumError as EquilibriumError
    from ._equilibrium import EquilibriumSolution as EquilibriumSolution
    from ._equilibrium import price_of_anarchy as price_of_anarchy
    from ._equilibrium import rif_latency_range as rif_latency_range
    from ._equilibrium import solve_equilibrium as solve_equilibrium
    from ._equilibrium.sensitivities import equilibrium_sensitivities as equilibrium_sensitivities
    from ._errors import OverloadError as OverloadError
    from ._errors import ScenarioError as ScenarioError
    from ._evaluation.experiment import ExperimentConfig as ExperimentConfig
    from ._evaluation.experiment import run_experiment as run_experiment
    from ._evaluation.generator import GeneratedScenarios as GeneratedScenarios
    from ._evaluation.generator import generate as generate
    from ._evaluation.generator import scenario_dicts as scenario_dicts
    from ._global_threshold import WorstCaseSearch as WorstCaseSearch
    from ._global_threshold import global_threshold as global_threshold
    from ._integrators import AbstractIntegrator as AbstractIntegrator
    from ._integrators import TickResult as TickResult
    from ._policies import MNLB as MNLB
    from ._policies import POLICY_NAMES as POLICY_NAMES
    from ._policies import AbstractCostPolicy as AbstractCostPolicy
    from ._policies import AbstractPolicy as AbstractPolicy
    from ._policies import AversionState as AversionState
    from ._policies import DiscreteRouting as DiscreteRouting
    from ._policies import ErrorAverse as ErrorAverse
    from ._policies import FlowRouting as FlowRouting
    from ._policies import Observation as Observation
    from ._policies import TickSetup as TickSetup
    from ._policies import WeightedRandom as WeightedRandom
    from ._policies import policy_from_name as policy_from_name
    from ._policies.aversion import ErrorAversion as ErrorAversion
    from ._policies.mnlb_weights import MNLB_STATUS as MNLB_STATUS
    from ._policies.mnlb_weights import MNLBInfo as MNLBInfo
    from ._policies.mnlb_weights import mnlb_weights as mnlb_weights
    from ._policies.projection import project_simplex as project_simplex
    from ._precision import enable_x64 as enable_x64
    from ._registry import COSTS as COSTS
    from ._registry import POLICIES as POLICIES
    from ._registry import SERVICE_MODELS as SERVICE_MODELS
    from ._registry import register_cost as register_cost
    from ._registry import register_policy as register_policy
    from ._registry import register_service_model as register_service_model
    from ._requests import RequestSolution as RequestSolution
    from ._requests import simulate_requests as simulate_requests
    from ._requests.estimation import EstimationReport as EstimationReport
    from ._requests.estimation import OnlineEstimation as OnlineEstimation
    from ._results import RESULTS as RESULTS
    from ._runtime.cache import enable_compilation_cache as enable_compilation_cache
    from ._runtime.devices import use_cpu_cores as use_cpu_cores
    from ._scenario import Scenario as Scenario
    from ._scenario import ServerCells as ServerCells
    from ._scenario import Workload as Workload
    from ._scenario import check_capacity as check_capacity
    from ._scenario import default_scenario as default_scenario
    from ._scenario import load_scenario as load_scenario
    from ._scenario import pad_scenario as pad_scenario
    from ._scenario import scenario_from_dict as scenario_from_dict
    from ._scenario import scenario_to_dict as scenario_to_dict
    from ._scenario import stack_scenarios as stack_scenarios
    from ._scenario import weighted_random_routing as weighted_random_routing
    from ._service import MM1 as MM1
    from ._service import AbstractServiceModel as AbstractServiceModel
    from ._service import ServiceModel as ServiceModel
    from ._service import Softplus as Softplus
    from ._service.estimation import FitInfo as FitInfo
    from ._service.estimation import fit_latency_model as fit_latency_model
    from ._service.estimation import perturb_service as perturb_service
    from ._service.estimation import sample_latency as sample_latency
    from ._simulate import LAYOUTS as LAYOUTS
    from ._simulate import STATUS as STATUS
    from ._simulate import Accurate as Accurate
    from ._simulate import Fast as Fast
    from ._simulate import SavePoint as SavePoint
    from ._simulate import SimState as SimState
    from ._simulate import SimulateOptions as SimulateOptions
    from ._simulate import SimulationError as SimulationError
    from ._simulate import Simulator as Simulator
    from ._simulate import Solution as Solution
    from ._simulate import Totals as Totals
    from ._simulate import simulate as simulate
    from ._simulate import simulator as simulator
    from ._stability import BatchStability as BatchStability
    from ._stability import HerdingResult as HerdingResult
    from ._stability import StabilityResult as StabilityResult
    from ._stability import batch_critical_step_size as batch_critical_step_size
    from ._stability import characteristic_roots as characteristic_roots
    from ._stability import critical_step_size as critical_step_size
    from ._stability import herding as herding
    from ._stability import linearise as linearise
    from ._stability import spectral_abscissa as spectral_abscissa
    from ._stability import step_size_ratio as step_size_ratio
    from ._stability import symmetric_critical_step_size as symmetric_critical_step_size
    from ._theorem1 import THEOREM1_ESTIMATES as THEOREM1_ESTIMATES
    from ._theorem1 import ProjectionCheck as ProjectionCheck
    from ._theorem1 import Theorem1Check as Theorem1Check
    from ._theorem1 import Theorem1Constants as Theorem1Constants
    from ._theorem1 import Theorem1Schedule as Theorem1Schedule
    from ._theorem1 import Theorem1ScheduleResult as Theorem1ScheduleResult
    from ._theorem1 import fit_bound as fit_bound
    from ._theorem1 import projection_check as projection_check
    from ._theorem1 import theorem1_check as theorem1_check
    from ._theorem1 import theorem1_constants as theorem1_constants
    from ._theorem1 import theorem1_schedule as theorem1_schedule
    from ._theorem1.lyapunov import Diagnostics as Diagnostics
    from ._theorem1.lyapunov import fit_theorem1 as fit_theorem1
    from ._theorem1.lyapunov import lyapunov_diagnostics as lyapunov_diagnostics
    from ._theorem1.lyapunov import workload_gap as workload_gap
    from ._theorem1.lyapunov import workload_potential as workload_potential
    from ._verify import VerifyConfig as VerifyConfig
    from ._verify import random_network as random_network
    from ._verify import verify as verify


def _public_names() -> dict[str, str]:
    """`{name: module}` from the `TYPE_CHECKING` imports above (parsed once)."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(__file__).read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If))
    return {
        a.asname or a.name: "." * node.level + (node.module or "")
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for a in node.names
    }


_NAMES = _public_names()
__all__ = sorted(_NAMES)


def __getattr__(name: str):
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'dlbfluid' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later uses skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NAMES))
