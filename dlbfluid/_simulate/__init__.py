"""The batched simulator of the delayed fluid model (`simulate`) and its parts."""

from .batchlast import vmap_last as vmap_last
from .loop import (
    CPU_CHUNK as CPU_CHUNK,
)
from .loop import (
    LAYOUTS as LAYOUTS,
)
from .loop import (
    Accurate as Accurate,
)
from .loop import (
    Fast as Fast,
)
from .loop import (
    SimState as SimState,
)
from .loop import (
    Totals as Totals,
)
from .loop import (
    _chosen_chunk as _chosen_chunk,
)
from .loop import (
    _chunked as _chunked,
)
from .loop import (
    _hist_len as _hist_len,
)
from .loop import (
    _init_state as _init_state,
)
from .loop import (
    _setup as _setup,
)
from .loop import (
    _tick as _tick,
)
from .loop import (
    _window_width as _window_width,
)
from .loop import (
    default_chunk as default_chunk,
)
from .loop import (
    default_layout as default_layout,
)
from .loop import (
    simulate as simulate,
)
from .solution import STATUS as STATUS
from .solution import SimulationError as SimulationError
from .solution import Solution as Solution
