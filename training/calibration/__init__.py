"""Measure what this machine achieves: matmul and attention FLOP/s by shape, memory bandwidth, and
collective latency and bandwidth between two local ranks. The result is the JSON document of a
hardware profile (service.planner.efficiency.HardwareProfile.from_dict reads it).

    from training.calibration import calibrate, Grid
    doc = calibrate("cpu-virtual", Grid.quick())
"""

from training.calibration.measure import Grid, calibrate

__all__ = ["Grid", "calibrate"]
