"""Runtime plumbing shared by the verbs: the resumable sweep that `verify` and
`run_experiment` both run (`sweep`)."""

from .sweep import CsvRows as CsvRows
from .sweep import JsonLines as JsonLines
from .sweep import Sweep as Sweep
