"""The simulator of the delayed fluid model (theory/model.md, theory/discretisation.md).

- `loop.py`: one scenario's loop: `SimState`, `Totals`, the tick and the record.
- `window.py`: the arrival window a tick reads.
- `single.py`: `Simulator` (`init`, `step`, `record`) and `simulator`, the public
  single-scenario API.
- `options.py`: `SimulateOptions`, the execution's tunables, and the chunk and layout
  choices made from them.
- `strategy.py`: the batched program (vmapped or batch-last, chunked, per device).
- `batchlast.py`: `vmap_last`, a one-scenario function on batch-last arrays.
- `verb.py`: `simulate`.
- `solution.py`: `Solution`, what `simulate` returns.
"""

from .._integrators import Accurate as Accurate
from .._integrators import Fast as Fast
from .batchlast import vmap_last as vmap_last
from .loop import SavePoint as SavePoint
from .loop import SimState as SimState
from .loop import Totals as Totals
from .loop import _hist_len as _hist_len
from .loop import _init_state as _init_state
from .loop import _setup as _setup
from .loop import _tick as _tick
from .options import LAYOUTS as LAYOUTS
from .options import SimulateOptions as SimulateOptions
from .options import _chosen_chunk as _chosen_chunk
from .options import default_chunk as default_chunk
from .options import default_layout as default_layout
from .single import Simulator as Simulator
from .single import simulator as simulator
from .solution import STATUS as STATUS
from .solution import SimulationError as SimulationError
from .solution import Solution as Solution
from .strategy import _chunked as _chunked
from .strategy import simulate_program as simulate_program
from .verb import simulate as simulate
from .window import ArrivalWindow as ArrivalWindow
from .window import _window_width as _window_width
