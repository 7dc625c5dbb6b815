"""The global step threshold $\\eta_g$ of flow routing, searched from worst starts
(theory/global_threshold.md): the settings (`config`), the late-window statistics and the
batched tick loop (`stats`), and the search (`search`)."""

from .config import CENSORING as CENSORING
from .config import HOPF as HOPF
from .config import WorstCaseSearch as WorstCaseSearch
from .search import RECORD_KEYS as RECORD_KEYS
from .search import _flat as _flat
from .search import _starts as _starts
from .search import global_threshold as global_threshold
from .stats import WorkloadStats as WorkloadStats
from .stats import _ascend as _ascend
from .stats import non_decaying as non_decaying
