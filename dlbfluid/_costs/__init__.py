"""Cost families $c_{ij} = f_j(N_j) + g_{ij}$ (one file per member)."""

from .base import AbstractCost as AbstractCost
from .base import arc_cost as arc_cost
from .base import check_cost as check_cost
from .base import cost_from_name as cost_from_name
from .base import destination_cost as destination_cost
from .base import route_costs as route_costs
from .base import short_name as short_name
from .gradient import Gradient as Gradient
from .latency import Latency as Latency
from .rif import RIF as RIF

COSTS = ("rif", "latency", "gradient")
"""The built-in cost families (the registry, `dlbfluid._registry.COSTS`, lists all)."""
