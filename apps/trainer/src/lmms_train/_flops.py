"""Model FLOPs utilisation: achieved model FLOP/s over the devices' peak.

MFU = model FLOPs of the step (6N + attention per token for the language model, plus the
vision tower's FLOPs, from the model spec's estimators; recomputation is *not* counted) over
(step time x world size x peak FLOP/s of one device). The peak table holds dense bf16 datasheet
numbers; override it with `trainer_args.peak_flops` (e.g. for fp32 runs or unknown devices).
"""

from __future__ import annotations

import torch

__all__ = ["CPU_NOMINAL_PEAK", "PEAK_FLOPS", "mfu", "peak_flops_for"]

# Dense bf16 tensor-core peak per device, FLOP/s (datasheet, no sparsity).
PEAK_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "H20": 148e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "A10": 125e12,
    "L40S": 362e12,
    "L4": 121e12,
    "4090": 165e12,
}
# A nominal CPU peak so that MFU is defined on laptops (order of one modern core's FP32 FMA
# throughput x a few cores); set `trainer_args.peak_flops` for a meaningful number.
CPU_NOMINAL_PEAK = 1e12


def peak_flops_for(device: torch.device, override: float | None = None) -> float:
    """Peak FLOP/s of one device: the override, the table by device name, or a nominal value."""
    if override:
        return float(override)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).upper()
        for key in sorted(PEAK_FLOPS, key=len, reverse=True):
            if key in name:
                return PEAK_FLOPS[key]
        return PEAK_FLOPS["H100"]
    return CPU_NOMINAL_PEAK


def mfu(flops: float, seconds: float, world_size: int, peak: float) -> float:
    """Fraction of the aggregate peak achieved (0 if the time is not positive)."""
    if seconds <= 0 or peak <= 0:
        return 0.0
    return flops / (seconds * world_size * peak)
