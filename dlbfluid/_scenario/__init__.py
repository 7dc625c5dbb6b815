"""Scenarios: the `Scenario` Module and its parts (`model`), the file format and the
validation of every field (`parse`, `io`), Assumption 2's capacity check
(`feasibility`), padding and batching (`batching`), and the arrival-rate profiles a
scenario carries (`arrivals`)."""

from .batching import pad_scenario as pad_scenario
from .batching import stack_scenarios as stack_scenarios
from .feasibility import _check_capacity as _check_capacity
from .feasibility import check_capacity as check_capacity
from .io import default_scenario as default_scenario
from .io import load_scenario as load_scenario
from .io import scenario_to_dict as scenario_to_dict
from .model import Scenario as Scenario
from .model import ServerCells as ServerCells
from .model import Workload as Workload
from .model import piecewise_constant as piecewise_constant
from .model import proportional_routing as proportional_routing
from .model import replica_scale as replica_scale
from .model import weighted_random_routing as weighted_random_routing
from .parse import scenario_from_dict as scenario_from_dict
