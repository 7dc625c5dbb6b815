"""Routing policies: an abstract family with one file per member, and the registry names."""

from .base import POLICY_NAMES as POLICY_NAMES
from .base import AbstractCostPolicy as AbstractCostPolicy
from .base import AbstractPolicy as AbstractPolicy
from .base import Observation as Observation
from .base import TickSetup as TickSetup
from .base import policy_from_name as policy_from_name
from .discrete import DiscreteRouting as DiscreteRouting
from .error_averse import AversionState as AversionState
from .error_averse import ErrorAverse as ErrorAverse
from .flow import FlowRouting as FlowRouting
from .mnlb import MNLB as MNLB
from .rand import WeightedRandom as WeightedRandom
