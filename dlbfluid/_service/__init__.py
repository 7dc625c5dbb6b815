"""Service models: the family of laws $\\mu_j(N)$ (one file per member) and the per-cell
table a scenario carries."""

from .base import AbstractServiceModel as AbstractServiceModel
from .base import ServiceModel as ServiceModel
from .base import code as code
from .base import law as law
from .base import service_from_cells as service_from_cells
from .mm1 import MM1 as MM1
from .softplus import Softplus as Softplus
from .softplus import latency_asymptotic as latency_asymptotic
from .softplus import softplus_sigmoid as softplus_sigmoid

BUILTIN_LAWS = (MM1.name, Softplus.name)
"""The laws this package defines. A table evaluating both (`ServiceModel.with_laws`) lets
M/M/1-only, softplus-only and mixed scenarios share one compiled program (the equilibrium
solver, `verify`'s chunks)."""
