"""Local stability of flow routing (theory/stability.md).

One module per concept:

* `linearisation`: the linear delay equation around an equilibrium (`linearise`,
  `Linearisation`), its feedback form (`local_gain`, batched by `loop_gain`) and the cell
  characteristic matrix (`CellLoop`), one home for the slopes that every method uses;
* `base`: the family of methods, `AbstractStabilityMethod`; each member lives beside its
  mathematics:
* `symmetric`: the closed form for one origin and two identical cells (§2; `Symmetric`);
* `pseudospectral`: Chebyshev collocation of the generator (§3.1-3.5; `Pseudospectral`);
* `nyquist`: the argument principle on the cell characteristic matrix (§3.6; `Nyquist`),
  with the one root count (`roots_in_right_half_plane`) that the batched search uses too;
* `methods`: `Auto` and the registry `METHODS` of the names (`stability_method`);
* `search`: the result record, progress, initial guess and bracket shared by the searches;
* `critical`: `critical_step_size` and `step_size_ratio`;
* `batched`: `batch_critical_step_size`, a whole batch in one compiled call (§7);
* `limit_cycle`: herding, the limit cycle of discrete routing from a simulation (§5);
* `threads`: the host eigenvalue problems on one BLAS thread.
"""

from .base import AbstractStabilityMethod
from .batched import STATUS, BatchSearch, BatchStability, batch_critical_step_size
from .critical import critical_step_size, step_size_ratio
from .limit_cycle import HerdingResult, herding, oscillation
from .linearisation import (
    CellLoop,
    Linearisation,
    LoopGain,
    _flow_policy,
    linearise,
    local_gain,
    loop_gain,
    scale_delays,
    tangent_basis,
)
from .methods import METHODS, Auto, stability_method
from .nyquist import Loci, Nyquist, nyquist_eta, roots_in_right_half_plane
from .pseudospectral import (
    Pseudospectral,
    Spectrum,
    characteristic_roots,
    chebyshev_differentiation,
    chebyshev_nodes,
    generator_matrix,
    spectral_abscissa,
)
from .search import StabilityResult, Steps, initial_guess
from .symmetric import (
    Symmetric,
    symmetric_critical_gain,
    symmetric_critical_step_size,
    symmetric_crossing_margin,
    symmetric_parameters,
)

__all__ = [
    "METHODS",
    "STATUS",
    "AbstractStabilityMethod",
    "Auto",
    "BatchSearch",
    "BatchStability",
    "CellLoop",
    "HerdingResult",
    "Linearisation",
    "Loci",
    "LoopGain",
    "Nyquist",
    "Pseudospectral",
    "Spectrum",
    "StabilityResult",
    "Steps",
    "Symmetric",
    "_flow_policy",
    "batch_critical_step_size",
    "characteristic_roots",
    "chebyshev_differentiation",
    "chebyshev_nodes",
    "critical_step_size",
    "generator_matrix",
    "herding",
    "initial_guess",
    "linearise",
    "local_gain",
    "loop_gain",
    "nyquist_eta",
    "oscillation",
    "roots_in_right_half_plane",
    "scale_delays",
    "spectral_abscissa",
    "stability_method",
    "step_size_ratio",
    "symmetric_critical_gain",
    "symmetric_critical_step_size",
    "symmetric_crossing_margin",
    "symmetric_parameters",
    "tangent_basis",
]
