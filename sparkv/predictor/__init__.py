"""Per-step compute latency of this device: profiler, learned MLP model, Roofline baseline.

The scheduler's ``t_comp(t, l)`` for a context::

    from sparkv.predictor import load_predictor

    model = load_predictor(path, lm=lm)           # the MLP, or a Roofline on another device
    t_comp = model.t_comp(geometry, sparse=True)  # float64[num_token_chunks, num_layers], seconds

See docs/predictor.md.
"""

from typing import TYPE_CHECKING

from sparkv.lazy import lazy_exports

if TYPE_CHECKING:
    from sparkv.predictor.cost import StepCostModel, mape
    from sparkv.predictor.device import (CpuUtilisation, UtilisationMonitor, current_utilisation,
                                         detect_monitor, device_fingerprint)
    from sparkv.predictor.features import FEATURE_NAMES, StepFeatures, causal_blocks
    from sparkv.predictor.load import LoadGenerator
    from sparkv.predictor.model import (DEFAULT_FEATURES, DeviceMismatchWarning, LatencyModel,
                                        PredictorFileError, load_predictor)
    from sparkv.predictor.profiler import ProfileConfig, Profiler, Sample, load_samples, save_samples
    from sparkv.predictor.roofline import ModelArch, Roofline, measure_peaks, step_work

#: name -> the module that defines it (imported on first use: :mod:`sparkv.lazy`)
_EXPORTS: dict[str, str] = {
    "StepCostModel": "sparkv.predictor.cost",
    "mape": "sparkv.predictor.cost",
    "CpuUtilisation": "sparkv.predictor.device",
    "UtilisationMonitor": "sparkv.predictor.device",
    "current_utilisation": "sparkv.predictor.device",
    "detect_monitor": "sparkv.predictor.device",
    "device_fingerprint": "sparkv.predictor.device",
    "FEATURE_NAMES": "sparkv.predictor.features",
    "StepFeatures": "sparkv.predictor.features",
    "causal_blocks": "sparkv.predictor.features",
    "LoadGenerator": "sparkv.predictor.load",
    "DEFAULT_FEATURES": "sparkv.predictor.model",
    "DeviceMismatchWarning": "sparkv.predictor.model",
    "LatencyModel": "sparkv.predictor.model",
    "PredictorFileError": "sparkv.predictor.model",
    "load_predictor": "sparkv.predictor.model",
    "ProfileConfig": "sparkv.predictor.profiler",
    "Profiler": "sparkv.predictor.profiler",
    "Sample": "sparkv.predictor.profiler",
    "load_samples": "sparkv.predictor.profiler",
    "save_samples": "sparkv.predictor.profiler",
    "ModelArch": "sparkv.predictor.roofline",
    "Roofline": "sparkv.predictor.roofline",
    "measure_peaks": "sparkv.predictor.roofline",
    "step_work": "sparkv.predictor.roofline",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

__all__ = [
    "StepCostModel", "mape", "CpuUtilisation", "UtilisationMonitor", "current_utilisation",
    "detect_monitor", "device_fingerprint", "FEATURE_NAMES", "StepFeatures", "causal_blocks",
    "LoadGenerator", "DEFAULT_FEATURES", "DeviceMismatchWarning", "LatencyModel",
    "PredictorFileError", "load_predictor", "ProfileConfig", "Profiler", "Sample",
    "load_samples", "save_samples", "ModelArch", "Roofline", "measure_peaks", "step_work",
]
