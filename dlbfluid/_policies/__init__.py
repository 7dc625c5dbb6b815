from .base import POLICY_NAMES as POLICY_NAMES
from .base import AbstractPolicy as AbstractPolicy
from .base import policy_from_name as policy_from_name
from .discrete import DiscreteRouting as DiscreteRouting
from .flow import FlowRouting as FlowRouting
from .mnlb import MNLB as MNLB
from .rand import WeightedRandom as WeightedRandom
