"""SM partitions for running the shared experts beside the routed ones: the device's SMs split into two CUDA
green contexts (cuda-python driver API), a fixed number for the shared experts and the rest for the routed
ones, each with a torch stream.

Hopper hands out SM groups in multiples of 8 (at least 8); Blackwell's granularity is read from the device.
The partition lives as long as the returned object; kernels launched on its stream run only on its SMs.
``device`` None (the default everywhere) is torch's current device: a TP rank that set its own device gets its
partitions there, not on device 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3tune.errors import ConfigError, HardwareError

SM_GRANULE = 8  # Hopper: partitions are multiples of 8 SMs


def _check(result, what: str):
    from cuda.bindings import driver as cuda

    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != cuda.CUresult.CUDA_SUCCESS:
        raise HardwareError(f"{what} failed: {err.name if hasattr(err, 'name') else err}")
    return rest[0] if len(rest) == 1 else rest


@dataclass
class SmPartition:
    sms: int  # SMs actually granted
    stream: object  # torch.cuda.ExternalStream on the green context
    _ctx: object = None
    _raw_stream: object = None

    def close(self) -> None:
        from cuda.bindings import driver as cuda

        if self._raw_stream is not None:
            cuda.cuStreamDestroy(self._raw_stream)
            self._raw_stream = None
        if self._ctx is not None:
            cuda.cuGreenCtxDestroy(self._ctx)
            self._ctx = None


def _device(device: int | None) -> int:
    import torch

    if not torch.cuda.is_available():
        raise HardwareError("SM partitions and side streams need a CUDA GPU")
    return torch.cuda.current_device() if device is None else device


_PLAIN: dict[int, object] = {}


def plain_stream(device: int | None = None):
    """A non-blocking torch stream on the primary context, one per device for the life of the process: the shared
    experts beside the routed ones on every SM (no partition), labelled as such."""
    import torch

    device = _device(device)
    if device not in _PLAIN:
        _PLAIN[device] = torch.cuda.Stream(device=device)
        _PLAIN[device].k3tune_label = "(plain, every SM)"
    return _PLAIN[device]


def green_partition(n_sms: int, device: int | None = None) -> SmPartition:
    """A green context of ``n_sms`` SMs (a multiple of 8) and a non-blocking torch stream on it."""
    return green_split(n_sms, device, rest=False).shared


@dataclass
class SmSplit:
    shared: SmPartition  # the shared experts' SMs
    rest: SmPartition | None  # every other SM: the routed experts' (None when not asked for)

    def close(self) -> None:
        self.shared.close()
        if self.rest is not None:
            self.rest.close()


def green_split(n_sms: int, device: int | None = None, rest: bool = True) -> SmSplit:
    """The device's SMs split in two green contexts, ``n_sms`` (a multiple of 8) and the rest, each with a
    non-blocking torch stream: kernels on one stream never run on the other's SMs."""
    import torch
    from cuda.bindings import driver as cuda

    if n_sms <= 0 or n_sms % SM_GRANULE:
        raise ConfigError(f"an SM partition needs a positive multiple of {SM_GRANULE} SMs, got {n_sms}")
    device = _device(device)
    total = torch.cuda.get_device_properties(device).multi_processor_count
    if n_sms >= total:
        raise ConfigError(f"an SM partition of {n_sms} SMs leaves nothing of the {total} SMs for the rest")
    torch.cuda.init()  # torch's primary context first: the green contexts share its device
    dev = _check(cuda.cuDeviceGet(device), "cuDeviceGet")
    res = _check(cuda.cuDeviceGetDevResource(dev, cuda.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM),
                 "cuDeviceGetDevResource")
    groups, _, remaining = _check(cuda.cuDevSmResourceSplitByCount(1, res, 0, n_sms), "cuDevSmResourceSplitByCount")
    shared = _on_green_context(groups[0], dev, device)
    return SmSplit(shared, _on_green_context(remaining, dev, device) if rest else None)


def _on_green_context(resource, dev, device: int) -> SmPartition:
    import torch
    from cuda.bindings import driver as cuda

    desc = _check(cuda.cuDevResourceGenerateDesc([resource], 1), "cuDevResourceGenerateDesc")
    ctx = _check(cuda.cuGreenCtxCreate(desc, dev, cuda.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM),
                 "cuGreenCtxCreate")
    raw = _check(cuda.cuGreenCtxStreamCreate(ctx, cuda.CUstream_flags.CU_STREAM_NON_BLOCKING, 0),
                 "cuGreenCtxStreamCreate")
    stream = torch.cuda.ExternalStream(int(raw), device=device)
    granted = resource.sm.smCount
    stream.k3tune_label = f"(green context, {granted} SMs)"
    return SmPartition(granted, stream, ctx, raw)


_CACHE: dict[tuple[int, int], SmSplit] = {}
_SUPERSEDED: list[SmSplit] = []  # kept open: blocks built on them (and their captured graphs) still use them


def shared_partition(n_sms: int, device: int | None = None, rest: bool = True) -> SmSplit:
    """One split per (size, device) for the life of the process: green contexts are not free to make. The
    shared experts run on ``.shared``, the routed experts on ``.rest`` (made only when ``rest``: a block whose
    routed experts keep every SM needs no second context; a split made with it serves both)."""
    device = _device(device)
    have = _CACHE.get((n_sms, device))
    if have is None or (rest and have.rest is None):
        if have is not None:
            _SUPERSEDED.append(have)
        _CACHE[(n_sms, device)] = green_split(n_sms, device, rest=rest)
    return _CACHE[(n_sms, device)]
