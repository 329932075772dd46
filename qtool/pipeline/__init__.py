"""The user-level jobs, one per module: calibrate and quantize (:mod:`.quantize`, over :mod:`.calibrate`'s one
recipe into a run directory), the size-budget search (:mod:`.search`), export and import-encodings
(:mod:`.export`), report and imatrix (:mod:`.measure`); :mod:`.manifest` records every run, :mod:`.common` holds
what they share (the process group, the inputs an output must not overwrite, the calibrated model's loader).

Each job takes its inputs resolved once at its edge (a recipe is read once: :class:`qtool.config.RecipeFile`),
returns data (a summary dict) and reports progress through callbacks; it never prints.
"""

from ..calibration import CalibrateOptions
from ..hooks import Hooks
from ..model.apply import apply_encodings
from ..provenance import versions
from .common import TargetOptions, load_calibrated, plan_for
from .export import AIMET_JSON_LIMIT, ExportOptions, run_export, run_import_encodings
from .measure import run_imatrix, run_report
from .quantize import run_calibrate, run_quantize
from .search import SEARCH_FILE, Measured, choose_recipe, measure_candidates

__all__ = ["CalibrateOptions", "ExportOptions", "TargetOptions", "Hooks", "plan_for", "run_calibrate", "run_export",
           "run_quantize", "run_import_encodings", "run_report", "run_imatrix", "load_calibrated", "versions",
           "apply_encodings", "measure_candidates", "choose_recipe", "Measured", "SEARCH_FILE", "AIMET_JSON_LIMIT"]
