"""Early exits on a frozen model: exit heads (heads.py), their distillation (train.py), their
calibration to a disagreement target (calibrate.py), and the per-request runtime over a chain of
slice runners cut at the exit layers (runtime.py)."""
