"""Per-step compute latency of this device: profiler, learned MLP model, Roofline baseline.

The scheduler's ``t_comp(t, l)`` for a context::

    from sparkv.predictor import load_predictor

    model = load_predictor(path, lm=lm)           # the MLP, or a Roofline on another device
    t_comp = model.t_comp(geometry, sparse=True)  # float64[num_token_chunks, num_layers], seconds

See docs/predictor.md.
"""

from sparkv.predictor.cost import StepCostModel, mape
from sparkv.predictor.device import (CpuUtilisation, UtilisationMonitor, current_utilisation,
                                     detect_monitor, device_fingerprint)
from sparkv.predictor.features import FEATURE_NAMES, StepFeatures, causal_blocks
from sparkv.predictor.load import LoadGenerator
from sparkv.predictor.model import (DEFAULT_FEATURES, DeviceMismatchWarning, LatencyModel,
                                    PredictorFileError, load_predictor)
from sparkv.predictor.profiler import ProfileConfig, Profiler, Sample, load_samples, save_samples
from sparkv.predictor.roofline import ModelArch, Roofline, measure_peaks, step_work

__all__ = [
    "StepCostModel", "mape", "CpuUtilisation", "UtilisationMonitor", "current_utilisation",
    "detect_monitor", "device_fingerprint", "FEATURE_NAMES", "StepFeatures", "causal_blocks",
    "LoadGenerator", "DEFAULT_FEATURES", "DeviceMismatchWarning", "LatencyModel",
    "PredictorFileError", "load_predictor", "ProfileConfig", "Profiler", "Sample",
    "load_samples", "save_samples", "ModelArch", "Roofline", "measure_peaks", "step_work",
]
