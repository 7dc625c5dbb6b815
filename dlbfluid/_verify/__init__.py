"""Batch verification of Theorem 1 over random scenarios (`verify`; theory/lyapunov.md,
*Batch verification*): the settings (`config`), the scenario sources (`networks`), one
chunk's records (`records`), the summary (`summary`), and the verb (`verb`), a resumable sweep
(`dlbfluid._runtime.Sweep`)."""

from .config import DEFAULT_CHUNK as DEFAULT_CHUNK
from .config import VerifyConfig as VerifyConfig
from .config import flow_policies as flow_policies
from .networks import draw_appb as draw_appb
from .networks import draw_appb_many as draw_appb_many
from .networks import draw_scenario as draw_scenario
from .networks import random_network as random_network
from .records import LADDER_KEYS as LADDER_KEYS
from .records import SEARCH_KEYS as SEARCH_KEYS
from .summary import summarise as summarise
from .verb import verify as verify
