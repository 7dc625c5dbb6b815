"""Runtime plumbing shared by the verbs, below the numerics: placing a batch on the devices
(`devices`), one run over several processes (`distributed`), programs kept on disk
(`exported`) and the persistent compilation cache (`cache`), progress lines (`progress`),
the manifest of a resumable output directory (`manifest`), the one resumable sweep
that `verify` and `run_experiment` share (`sweep`), and host-side arrays and `jnp` work
without a compilation per operation (`eager`)."""

from .sweep import CsvRows as CsvRows
from .sweep import JsonLines as JsonLines
from .sweep import Sweep as Sweep
