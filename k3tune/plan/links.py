"""The TP links k3tune models: what the one-GPU stand-ins for a TP group's collectives are timed by.

``k3tune.runtime.moe.EmulatedComm`` occupies the GPU, for each collective of the MoE block, for the time a
``latency_us`` + ring-bytes / ``nvlink_gbps`` link would take. Those figures decide a measured block's time,
so this module is in the MoE blocks' key; it is kept apart from ``k3tune.plan.hardware`` so that a new GPU's
spec there does not re-key every block winner. Bandwidths are the vendors' published NVLink figures per
direction (GB/s); the latency is a per-collective start-up cost for a small message in one NVLink domain.
"""

from __future__ import annotations

from k3tune.errors import HardwareError

NVLINK_GBPS: dict[str, float] = {"gb300": 900.0, "b200": 900.0, "h200": 450.0, "h100": 450.0}
LATENCY_US = 4.0  # a small all-reduce's start-up in one NVLink domain


def nvlink_gbps(hardware: str) -> float:
    """The NVLink bandwidth per direction (GB/s) of a hardware key (k3tune.plan.hardware.SPECS)."""
    if hardware not in NVLINK_GBPS:
        raise HardwareError(f"no NVLink figure for hardware '{hardware}' (known: {', '.join(NVLINK_GBPS)})")
    return NVLINK_GBPS[hardware]
