"""Equilibria as one batched convex program: problem and certificate, the Newton systems,
the two solver stages (one file each), the solver, and the public verb."""

from .anarchy import price_of_anarchy as price_of_anarchy
from .api import EQ_STATUS as EQ_STATUS
from .api import EquilibriumError as EquilibriumError
from .api import EquilibriumSolution as EquilibriumSolution
from .api import solve_equilibrium as solve_equilibrium
from .base import AbstractStage as AbstractStage
from .interior_point import InteriorPoint as InteriorPoint
from .linalg import _mmatrix_apply as _mmatrix_apply
from .linalg import _mmatrix_factor as _mmatrix_factor
from .linalg import _newton_direction as _newton_direction
from .polish import ActiveSetPolish as ActiveSetPolish
from .problem import _certify as _certify
from .problem import _make_problem as _make_problem
from .problem import potential as potential
from .rif_range import rif_latency_range as rif_latency_range
from .solver import _TRACES as _TRACES
from .solver import EquilibriumSolver as EquilibriumSolver
from .state import Iterate as Iterate
from .state import SolverState as SolverState
