import os
import sys

import jax

# Reference comparisons run in float64; importing dlbfluid enables it too, but tests must
# not depend on import order.
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("MPLBACKEND", "Agg")
