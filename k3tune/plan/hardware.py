"""Hardware: published specs of the GPUs k3tune knows, detection of the local GPU, and its fingerprint.

Specs are the vendors' published figures (approximate where the vendor gives a range); ``bw_efficiency`` is the
fraction of the spec bandwidth a device-to-device copy reaches (measured on the H200: 4.20 of 4.8 TB/s), and
``graph_launch_us`` the cost of one kernel inside a CUDA graph (measured on the H200: 2.5-3 us).
"""

from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import asdict, dataclass, field

from k3tune.errors import HardwareError
from k3tune.plan import links

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class HardwareSpec:
    key: str  # short name used on the command line
    name: str  # what torch.cuda.get_device_name reports
    compute_capability: tuple[int, int]
    sm_count: int
    memory_bytes: int
    hbm_tbps: float  # published HBM bandwidth, TB/s
    bw_efficiency: float
    l2_bytes: int
    bf16_tflops: float  # dense tensor-core bf16
    fp32_tflops: float  # CUDA-core fp32 FMA
    graph_launch_us: float
    sm_partition_granularity: int  # green-context SM groups come in multiples of this

    @property
    def copy_bw(self) -> float:
        """Achievable HBM bandwidth in bytes/s: the roofline ceiling."""
        return self.hbm_tbps * 1e12 * self.bw_efficiency

    @property
    def nvlink_gbps(self) -> float:
        """Per direction, GB/s (k3tune.plan.links: the MoE blocks' key covers it, not this module)."""
        return links.nvlink_gbps(self.key)

    @property
    def arch(self) -> str:
        major, minor = self.compute_capability
        return f"sm_{major}{minor}a"


SPECS: dict[str, HardwareSpec] = {
    s.key: s
    for s in [
        HardwareSpec("gb300", "NVIDIA GB300", (10, 3), 160, 288 * GiB, 8.0, 0.88, 126 * MiB, 2500.0, 80.0, 2.2, 8),
        HardwareSpec("b200", "NVIDIA B200", (10, 0), 148, 180 * GiB, 8.0, 0.88, 126 * MiB, 2250.0, 75.0, 2.2, 8),
        HardwareSpec("h200", "NVIDIA H200", (9, 0), 132, 141 * GiB, 4.8, 0.875, 60 * MiB, 989.0, 67.0, 2.6, 8),
        HardwareSpec("h100", "NVIDIA H100 80GB HBM3", (9, 0), 132, 80 * GiB, 3.35, 0.88, 50 * MiB, 989.0, 67.0, 2.6, 8),
    ]
}


def spec(key: str) -> HardwareSpec:
    k = key.strip().lower()
    if k not in SPECS:
        raise HardwareError(f"unknown hardware '{key}' (known: {', '.join(SPECS)})")
    return SPECS[k]


def spec_for_device_name(name: str) -> HardwareSpec | None:
    n = name.upper()
    for key in ("gb300", "b200", "h200", "h100"):
        if key.upper() in n:
            return SPECS[key]
    return None


@dataclass(frozen=True)
class Fingerprint:
    """What identifies the hardware a result was measured (or simulated) on."""

    name: str
    compute_capability: str
    sm_count: int
    memory_gib: int
    driver: str
    cuda: str
    simulated: bool
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def class_key(self) -> str:
        """Results are served across machines of one class; driver and CUDA changes only warn."""
        sim = "sim:" if self.simulated else ""
        return f"{sim}{self.name}|cc{self.compute_capability}|{self.sm_count}sm|{self.memory_gib}GiB"

    @property
    def digest(self) -> str:
        d = asdict(self)
        d.pop("extra")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def simulated_fingerprint(hw: HardwareSpec) -> Fingerprint:
    cc = "%d.%d" % hw.compute_capability
    return Fingerprint(hw.name, cc, hw.sm_count, round(hw.memory_bytes / GiB), "simulated", "simulated", True)


def detect(device_index: int = 0) -> tuple[Fingerprint, HardwareSpec | None] | None:
    """The local GPU's fingerprint and matching spec, or None where torch sees no CUDA GPU."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device_index)
    driver = "unknown"
    try:
        from cuda.bindings import driver as cu

        err, ver = cu.cuDriverGetVersion()
        if int(err) == 0:
            driver = f"{ver // 1000}.{(ver % 1000) // 10}"
    except Exception:  # cuda-python missing or too old: the driver version is informative only
        pass
    fp = Fingerprint(
        name=props.name,
        compute_capability=f"{props.major}.{props.minor}",
        sm_count=props.multi_processor_count,
        memory_gib=round(props.total_memory / GiB),
        driver=driver,
        cuda=str(torch.version.cuda),
        simulated=False,
        extra={"host": platform.node()},
    )
    return fp, spec_for_device_name(props.name)


def resolve_simulated(value: str | None, configured: str | None) -> HardwareSpec:
    """--simulate [NAME]: 'auto' means the detected GPU, else the configured one (K3TUNE_HARDWARE)."""
    if value and value != "auto":
        return spec(value)
    found = detect()
    if found and found[1]:
        return found[1]
    if configured:
        try:
            return spec(configured)
        except HardwareError as e:  # named as the environment's, not as if --simulate had said it
            raise HardwareError(f"K3TUNE_HARDWARE={configured}: {e}") from None
    raise HardwareError("--simulate without a name needs a detected GPU or K3TUNE_HARDWARE; name one, e.g. --simulate gb300")
