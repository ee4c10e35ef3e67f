"""Which device a tuning result belongs to: GPU identity from NVML, or the CPU.

The autotuner's cache is keyed by the device that ran the measurement. On CUDA the identity comes
from NVML (nvidia-ml-py): name, memory, SM count, maximum clocks, and, for the record, the NVLink
and PCIe links; CUDA's own device properties fill in what NVML cannot give. Without a GPU, or on
the CPU device, the identity is ``"cpu"`` with the CPU model and core count. Nothing here raises
because NVML, a driver or a GPU is missing: every NVML call is guarded.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass(frozen=True)
class DeviceIdentity:
    """What the autotuner knows about the device that runs the model.

    Attributes:
        kind: ``"cuda"`` or ``"cpu"``.
        name: the GPU's marketing name (``"NVIDIA H100 80GB HBM3"``), or ``"cpu"``.
        memory_gib: device memory in GiB (GPU), or host memory (CPU); 0.0 where unknown.
        sm_count: streaming multiprocessors (GPU), or logical cores (CPU); 0 where unknown.
        max_sm_clock_mhz: maximum SM clock (GPU; 0 where unknown or on CPU).
        max_mem_clock_mhz: maximum memory clock (GPU; 0 where unknown or on CPU).
        cpu_model: the host CPU's model string (always filled, for the record).
        source: where the GPU facts came from: ``"nvml"``, ``"torch"`` (CUDA properties, NVML
            missing) or ``"cpu"``.
        details: informational extras not used in cache keys (driver, NVLink, PCIe, ...).
    """

    kind: str
    name: str
    memory_gib: float = 0.0
    sm_count: int = 0
    max_sm_clock_mhz: int = 0
    max_mem_clock_mhz: int = 0
    cpu_model: str = ""
    source: str = "cpu"
    details: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def key(self) -> str:
        """The cache-key form: every field that changes performance, nothing that does not."""
        if self.kind == "cpu":
            return f"cpu|{self.cpu_model}|{self.sm_count} cores"
        return (
            f"{self.name}|{self.memory_gib:.0f}GiB|{self.sm_count}SM|"
            f"{self.max_sm_clock_mhz}/{self.max_mem_clock_mhz}MHz"
        )

    def as_dict(self) -> dict:
        return dict(
            kind=self.kind,
            name=self.name,
            memory_gib=self.memory_gib,
            sm_count=self.sm_count,
            max_sm_clock_mhz=self.max_sm_clock_mhz,
            max_mem_clock_mhz=self.max_mem_clock_mhz,
            cpu_model=self.cpu_model,
            source=self.source,
            details=dict(self.details),
        )


def cpu_model() -> str:
    """The host CPU's model name (``/proc/cpuinfo`` on Linux, else :func:`platform.processor`)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _host_memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 0.0


def cpu_identity() -> DeviceIdentity:
    """The identity of the CPU device: name ``"cpu"``, model and cores."""
    return DeviceIdentity(
        kind="cpu",
        name="cpu",
        memory_gib=round(_host_memory_gib(), 1),
        sm_count=_cpu_cores(),
        cpu_model=cpu_model(),
        source="cpu",
    )


def nvml_info(device_index: int = 0) -> Optional[dict]:
    """NVML's facts about one GPU, or None when NVML, its library or the GPU is unavailable.

    Args:
        device_index: the CUDA device index as torch sees it (``CUDA_VISIBLE_DEVICES`` applies);
            it is matched to NVML's device by UUID or PCI bus id when torch can tell them.

    Returns:
        A dict with ``name``, ``memory_gib``, ``max_sm_clock_mhz``, ``max_mem_clock_mhz`` and,
        where NVML answers, ``driver``, ``nvlink_active`` (active NVLink links),
        ``pcie_gen``, ``pcie_width``, ``compute_capability``; None on any NVML failure.
    """
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return None
    try:
        handle = _nvml_handle(pynvml, device_index)
        if handle is None:
            return None
        info: dict[str, Any] = {"name": _text(pynvml.nvmlDeviceGetName(handle))}
        info["memory_gib"] = round(pynvml.nvmlDeviceGetMemoryInfo(handle).total / 2**30, 1)
        for name, clock in (("max_sm_clock_mhz", "NVML_CLOCK_SM"), ("max_mem_clock_mhz", "NVML_CLOCK_MEM")):
            info[name] = _try(lambda c=clock: int(pynvml.nvmlDeviceGetMaxClockInfo(handle, getattr(pynvml, c))), 0)
        driver = _try(lambda: _text(pynvml.nvmlSystemGetDriverVersion()), None)
        if driver:
            info["driver"] = driver
        cc = _try(lambda: pynvml.nvmlDeviceGetCudaComputeCapability(handle), None)
        if cc:
            info["compute_capability"] = f"{cc[0]}.{cc[1]}"
        info["nvlink_active"] = _nvlink_active(pynvml, handle)
        gen = _try(lambda: int(pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)), None)
        width = _try(lambda: int(pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle)), None)
        if gen is not None:
            info["pcie_gen"] = gen
        if width is not None:
            info["pcie_width"] = width
        return info
    except Exception:  # any NVML error means "no NVML facts", never a crash
        return None
    finally:
        _try(pynvml.nvmlShutdown, None)


def _nvml_handle(pynvml, device_index: int):
    """NVML's handle for torch's device ``device_index``: by UUID, then PCI bus id, then index."""
    props = _cuda_props(device_index)
    if props is not None:
        uuid = getattr(props, "uuid", None)
        if uuid is not None:
            text = str(uuid)
            for candidate in (text, f"GPU-{text}"):
                handle = _try(lambda c=candidate: pynvml.nvmlDeviceGetHandleByUUID(c), None)
                if handle is not None:
                    return handle
        bus = getattr(props, "pci_bus_id", None)
        if bus is not None:
            domain = getattr(props, "pci_domain_id", 0)
            dev = getattr(props, "pci_device_id", 0)
            handle = _try(lambda: pynvml.nvmlDeviceGetHandleByPciBusId(f"{domain:08x}:{bus:02x}:{dev:02x}.0"), None)
            if handle is not None:
                return handle
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    index = device_index
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if device_index < len(ids) and ids[device_index].isdigit():
            index = int(ids[device_index])
    return _try(lambda: pynvml.nvmlDeviceGetHandleByIndex(index), None)


def _nvlink_active(pynvml, handle) -> int:
    active = 0
    for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED:
                active += 1
        except Exception:  # NotSupported on PCIe parts, past the last link
            break
    return active


def _cuda_props(device_index: int):
    try:
        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(device_index)
    except Exception:
        pass
    return None


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _try(fn, default):
    try:
        return fn()
    except Exception:
        return default


def device_identity(device=None) -> DeviceIdentity:
    """The identity of ``device`` for cache keys; never raises for a missing NVML or GPU.

    Args:
        device: a ``torch.device``, a string such as ``"cuda:1"`` or ``"cpu"``, or None for
            CUDA device 0 when CUDA is available, else the CPU.

    Returns:
        A :class:`DeviceIdentity`. CPU devices, and CUDA requests on a machine without CUDA, give
        the CPU identity (``name == "cpu"``). A CUDA device uses NVML, completed by CUDA's device
        properties (SM count); when NVML is unavailable, CUDA's properties alone (``source="torch"``).
    """
    if device is None:
        device = "cuda" if _try(torch.cuda.is_available, False) else "cpu"
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError) as exc:
        raise ValueError(f"device must be a torch.device or a device string, got {device!r}") from exc
    if device.type != "cuda":
        return cpu_identity()
    index = device.index if device.index is not None else _try(torch.cuda.current_device, 0)
    props = _cuda_props(index)
    nvml = nvml_info(index)
    if nvml is None and props is None:
        return cpu_identity()
    sm = int(getattr(props, "multi_processor_count", 0) or 0) if props is not None else 0
    details = {}
    if nvml is not None:
        details = {
            k: v for k, v in nvml.items() if k not in ("name", "memory_gib", "max_sm_clock_mhz", "max_mem_clock_mhz")
        }
        return DeviceIdentity(
            kind="cuda",
            name=nvml["name"],
            memory_gib=nvml["memory_gib"],
            sm_count=sm,
            max_sm_clock_mhz=nvml["max_sm_clock_mhz"],
            max_mem_clock_mhz=nvml["max_mem_clock_mhz"],
            cpu_model=cpu_model(),
            source="nvml",
            details=details,
        )
    if getattr(props, "major", None) is not None:
        details["compute_capability"] = f"{props.major}.{props.minor}"
    clock_khz = int(getattr(props, "clock_rate", 0) or 0)
    return DeviceIdentity(
        kind="cuda",
        name=str(props.name),
        memory_gib=round(props.total_memory / 2**30, 1),
        sm_count=sm,
        max_sm_clock_mhz=clock_khz // 1000,
        cpu_model=cpu_model(),
        source="torch",
        details=details,
    )
