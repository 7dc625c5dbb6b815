"""Integrators of the workload ODE across one probe tick (one file per member)."""

from .accurate import Accurate as Accurate
from .base import AbstractIntegrator as AbstractIntegrator
from .base import TickResult as TickResult
from .fast import Fast as Fast
