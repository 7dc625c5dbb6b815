"""Theorem 1 (seed §4.1, App. C.3) made computable: its constants as formulas in scenario
data (`constants`), the bound and each estimate of its proof checked along simulated
trajectories (`check`), the routers' projection inequality as a diagnostic
(`projection_check`), and a descriptive fit of the theorem's shape on a ladder of runs
(`ladder`), and the $T^{-1/2}$ schedule where its steps stay below $\\eta_0$ (`schedule`).
theory/lyapunov.md states every formula and names the function that computes
it.
"""

from .check import ESTIMATES as ESTIMATES
from .check import Theorem1Check as Theorem1Check
from .check import batch_theorem1_check as batch_theorem1_check
from .check import theorem1_check as theorem1_check
from .constants import StartTerms as StartTerms
from .constants import Theorem1Constants as Theorem1Constants
from .constants import batch_start_terms as batch_start_terms
from .constants import batch_theorem1_constants as batch_theorem1_constants
from .constants import theorem1_constants as theorem1_constants
from .constants import thresholds as thresholds
from .ladder import BOUND_TOLERANCE as BOUND_TOLERANCE
from .ladder import DELAY_SHARE as DELAY_SHARE
from .ladder import FALLING as FALLING
from .ladder import Ladder as Ladder
from .ladder import bound as bound
from .ladder import delay_share as delay_share
from .ladder import empirical_eta0 as empirical_eta0
from .ladder import fit_bound as fit_bound
from .ladder import growth_exponent as growth_exponent
from .ladder import ladder_start as ladder_start
from .ladder import schedule_constant as schedule_constant
from .ladder import schedule_slope as schedule_slope
from .ladder import theorem1_ladder as theorem1_ladder
from .ladder import window_ratio as window_ratio
from .projection import ProjectionCheck as ProjectionCheck
from .projection import batch_projection_check as batch_projection_check
from .projection import projection_check as projection_check
from .schedule import Theorem1Schedule as Theorem1Schedule
from .schedule import Theorem1ScheduleResult as Theorem1ScheduleResult
from .schedule import theorem1_schedule as theorem1_schedule

THEOREM1_ESTIMATES = ESTIMATES
"""The estimates `Theorem1Check` measures, in its column order (public name)."""
