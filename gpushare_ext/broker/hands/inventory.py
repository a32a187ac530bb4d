"""What GPUs this host has, and how they are cut: an NVML backend and a simulated twin.

The broker asks an :class:`InventoryBackend` for the static description of every
device (:class:`DeviceInfo`: memory, SMs, MIG mode, the GPU-instance profiles and the
instances that exist) and, periodically, for a :class:`DeviceReading` (memory in use,
utilisation, processes).  Both are msgspec Structs so they travel in protocol messages
unchanged.

Backends:

* :class:`NvmlInventory` reads a real device through nvidia-ml-py.  It only reads: it
  never changes a MIG layout, a clock or a mode.
* :class:`SimulatedInventory` loads a JSON description in the format of the real H200
  readout shipped as ``fixtures/h200.json`` (several devices and an already
  partitioned layout are allowed), and says loudly that it simulates.

``open_inventory("auto")`` picks NVML when it initialises and otherwise falls back to
the simulated H200, with a message saying so.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Protocol

from gpushare_ext.broker.errors import DaemonError
from gpushare_ext.devices import (
    MIB,
    DeviceInfo,
    DeviceReading,
    MigInstance,
    MigProfile,
    ProcessUsage,
)
from gpushare_ext.safe_fs import UnsafePathError, read_trusted_file

# Official names of the GPU-instance profiles of the Hopper parts we know, keyed by
# (profile id, memory MiB).  Anything else is named from its slice count and memory.
_KNOWN_PROFILE_NAMES: dict[tuple[int, int], str] = {
    (0, 16384): "1g.18gb",
    (7, 16384): "1g.18gb+me",
    (9, 33280): "1g.35gb",
    (1, 33280): "2g.35gb",
    (2, 71424): "3g.71gb",
    (3, 71424): "4g.71gb",
    (4, 143360): "7g.141gb",
    (0, 10240): "1g.10gb",
    (7, 10240): "1g.10gb+me",
    (9, 20096): "1g.20gb",
    (1, 20096): "2g.20gb",
    (2, 40448): "3g.40gb",
    (3, 40448): "4g.40gb",
    (4, 81408): "7g.80gb",
}

# NVML profile ids that carry the media extensions (decoders, JPEG, OFA).
_MEDIA_EXTENSION_PROFILE_IDS = {7}

# Memory slices a profile occupies and where it may start, for the 8-memory-slice
# layout of A100/H100/H200 (MIG user guide, "supported profiles").  Keyed by profile id.
# NVML can report these (nvmlDeviceGetGpuInstancePossiblePlacements); we fall back to
# this table when it cannot, e.g. in a simulated inventory.
_PLACEMENT_RULES: dict[int, tuple[int, tuple[int, ...]]] = {
    0: (1, (0, 1, 2, 3, 4, 5, 6)),  # 1g.*: one memory slice, anywhere but the last
    7: (1, (0, 1, 2, 3, 4, 5, 6)),  # 1g.*+me
    9: (2, (0, 2, 4, 6)),  # 1g with two memory slices
    1: (2, (0, 2, 4)),  # 2g
    2: (4, (0, 4)),  # 3g
    3: (4, (0,)),  # 4g
    4: (8, (0,)),  # 7g
}


#: The largest inventory file read (the shipped fixtures are a few KiB).
_INVENTORY_MAX_BYTES = 16 << 20


class InventoryError(DaemonError):
    """A device description could not be read or parsed; the message says which and why."""


def managed_devices(devices: list[DeviceInfo], wanted: list[int] | None) -> list[DeviceInfo]:
    """The devices a broker configured with ``devices = wanted`` manages (all when None);
    InventoryError if that names none of them (the broker would have nothing to serve)."""
    chosen = [d for d in devices if wanted is None or d.index in wanted]
    if not chosen:
        raise InventoryError(
            f"none of the devices {wanted} exists here "
            f"(the inventory has {[d.index for d in devices]})"
        )
    return chosen


class InventoryBackend(Protocol):
    """Where the broker learns about devices; one real and one simulated implementation."""

    kind: str  # "nvml" or "simulated"
    description: str

    def devices(self) -> list[DeviceInfo]: ...

    def readings(self) -> list[DeviceReading]: ...

    def host_memory(self) -> HostMemoryReading | None: ...

    def close(self) -> None: ...


def profile_name(profile_id: int, slice_count: int, memory_mib: int) -> str:
    known = _KNOWN_PROFILE_NAMES.get((profile_id, memory_mib))
    if known:
        return known
    suffix = "+me" if profile_id in _MEDIA_EXTENSION_PROFILE_IDS else ""
    return f"{slice_count}g.{math.ceil(memory_mib / 1024)}gb{suffix}"


def _profile_from_json(raw: dict) -> MigProfile:
    pid = int(raw["id"])
    slices, starts = _PLACEMENT_RULES.get(pid, (int(raw["slice_count"]), (0,)))
    return MigProfile(
        id=pid,
        name=str(raw.get("name") or profile_name(pid, raw["slice_count"], raw["memory_mib"])),
        slice_count=int(raw["slice_count"]),
        memory_mib=int(raw["memory_mib"]),
        multiprocessor_count=int(raw["multiprocessor_count"]),
        instance_count=int(raw["instance_count"]),
        memory_slices=int(raw.get("memory_slices", slices)),
        placements=tuple(raw.get("placements", starts)),
        media_extensions=pid in _MEDIA_EXTENSION_PROFILE_IDS,
    )


def _instance_from_json(
    raw: dict, profiles: dict[int, MigProfile], device_uuid: str
) -> MigInstance:
    pid = int(raw["profile_id"])
    profile = profiles.get(pid)
    if profile is None:
        raise InventoryError(f"MIG instance {raw!r} names profile {pid}, which the device lacks")
    gi = int(raw.get("gpu_instance_id", raw.get("start", 0)))
    ci = int(raw.get("compute_instance_id", 0))
    return MigInstance(
        uuid=str(raw.get("uuid") or f"MIG-{device_uuid[4:12]}-{gi:04x}-{ci:04x}-sim"),
        profile_id=pid,
        name=profile.name,
        gpu_instance_id=gi,
        compute_instance_id=ci,
        memory_mib=int(raw.get("memory_mib", profile.memory_mib)),
        multiprocessor_count=int(raw.get("multiprocessor_count", profile.multiprocessor_count)),
        start=int(raw.get("start", 0)),
        size=int(raw.get("size", profile.memory_slices)),
    )


def parse_inventory(document: dict, *, simulated: bool) -> list[DeviceInfo]:
    """Turn a JSON description (the fixture's format) into devices; raise InventoryError."""
    try:
        raw_devices = document["devices"]
    except (KeyError, TypeError) as exc:
        raise InventoryError("inventory JSON has no 'devices' list") from exc
    devices = []
    for position, raw in enumerate(raw_devices):
        try:
            profiles = tuple(_profile_from_json(p) for p in raw.get("gpu_instance_profiles", []))
            by_id = {p.id: p for p in profiles}
            mig = raw.get("mig_mode", {}) or {}
            uuid = str(raw.get("uuid") or f"GPU-sim-{position:04d}")
            instances = tuple(
                _instance_from_json(i, by_id, uuid) for i in raw.get("mig_instances", [])
            )
            devices.append(
                DeviceInfo(
                    index=int(raw.get("index", position)),
                    name=str(raw["name"]),
                    uuid=uuid,
                    memory_total_mib=int(raw["memory_total_mib"]),
                    multiprocessor_count=int(raw["multiprocessor_count"]),
                    compute_capability=tuple(raw.get("compute_capability", (0, 0))),  # type: ignore[arg-type]
                    driver_version=str(raw.get("driver_version", "unknown")),
                    mig_enabled=bool(mig.get("current", 0)),
                    mig_pending=bool(mig.get("pending", 0)),
                    compute_mode=int(raw.get("compute_mode", 0)),
                    profiles=profiles,
                    instances=instances,
                    simulated=simulated,
                )
            )
        except InventoryError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise InventoryError(
                f"device #{position} of the inventory JSON is malformed: {exc}"
            ) from exc
    if not devices:
        raise InventoryError("inventory JSON lists no devices")
    indices = [d.index for d in devices]
    if len(set(indices)) != len(indices):
        raise InventoryError(f"inventory JSON repeats a device index: {indices}")
    return devices


def fixture_path(name: str) -> Path:
    """Path of a JSON inventory shipped with the package (``h200``, ``h200-mig-mixed`` ...)."""
    resource = resources.files("gpushare_ext") / "fixtures" / f"{name}.json"
    return Path(str(resource))


def shipped_fixtures() -> list[str]:
    folder = resources.files("gpushare_ext") / "fixtures"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


def _processes_outside_leases(document: dict, path: Path) -> dict[int, tuple[ProcessUsage, ...]]:
    """A simulated document's ``processes_outside_leases``, per device index."""
    found: dict[int, list[ProcessUsage]] = {}
    for entry in document.get("processes_outside_leases", []):
        try:
            device, pid, used = int(entry["device"]), int(entry["pid"]), int(entry["used_mib"])
            mig_uuid = entry.get("mig_uuid")
            if mig_uuid is not None and not isinstance(mig_uuid, str):
                raise TypeError(mig_uuid)
        except (KeyError, TypeError, ValueError) as exc:
            raise InventoryError(
                f"{path}: processes_outside_leases entries need device, pid and used_mib "
                f"(integers), and may name a mig_uuid (text): {entry!r}"
            ) from exc
        found.setdefault(device, []).append(ProcessUsage(pid=pid, used_mib=used, mig_uuid=mig_uuid))
    return {device: tuple(processes) for device, processes in found.items()}


@dataclass(frozen=True)
class HostMemoryReading:
    available_bytes: int
    total_bytes: int


def read_host_memory(meminfo: Path = Path("/proc/meminfo")) -> HostMemoryReading | None:
    """The host's available and total memory (``MemAvailable``, ``MemTotal``); None
    where the file cannot be read."""
    values: dict[str, int] = {}
    try:
        for line in meminfo.read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in ("MemAvailable", "MemTotal"):
                values[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if len(values) != 2:
        return None
    return HostMemoryReading(available_bytes=values["MemAvailable"], total_bytes=values["MemTotal"])


def _host_memory(document: dict, path: Path) -> HostMemoryReading | None:
    """A simulated document's ``host_memory`` (``{"total_mib": ..., "available_mib": ...}``)."""
    entry = document.get("host_memory")
    if entry is None:
        return None
    try:
        total, available = int(entry["total_mib"]), int(entry["available_mib"])
    except (KeyError, TypeError, ValueError) as exc:
        raise InventoryError(
            f"{path}: host_memory needs total_mib and available_mib (integers): {entry!r}"
        ) from exc
    return HostMemoryReading(available_bytes=available * MIB, total_bytes=total * MIB)


class SimulatedInventory:
    """Devices described by a JSON file; readings derived from the leases the broker reports.

    It never pretends to be real: ``kind`` is "simulated" and ``description`` says which
    file it serves.  Memory in use is what the broker tells it through
    :meth:`set_usage` (the sum of the leases' quotas), utilisation is 100 % while any
    lease runs on the device.  A document may also list processes that hold memory
    outside any lease (``"processes_outside_leases": [{"device": 0, "pid": 4242,
    "used_mib": 61440}]``): they are added to every reading, as NVML would show an idle
    notebook or a program the broker does not know, except while the broker's simulated
    checkpoint holds that process (:meth:`set_checkpointed`): a parked notebook's memory
    is on the host.  ``host_memory`` (``{"total_mib": ..., "available_mib": ...}``) stands
    for the host's own memory where a test needs a host larger than the machine, and
    ``restore_fails`` (process ids) makes the simulated restore of those fail;
    ``lock_drain_ms`` makes each simulated lock take that long, as a real one waits for
    the locked process's queued work.
    """

    kind = "simulated"

    def __init__(self, source: str | Path) -> None:
        path = Path(source)
        if not path.exists():
            candidate = fixture_path(str(source))
            if not candidate.exists():
                raise InventoryError(
                    f"no inventory file {str(source)!r}; give a JSON path or one of the shipped "
                    f"fixtures: {', '.join(shipped_fixtures())}"
                )
            path = candidate
        try:
            # A root broker believes what this file says about the host: it is read only
            # if no other user can have written it.
            data = read_trusted_file(
                path, trusted={os.geteuid()}, max_bytes=_INVENTORY_MAX_BYTES, what="inventory"
            )
            document = json.loads(data)
        except UnsafePathError as exc:
            raise InventoryError(str(exc)) from None
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            reason = "nests too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise InventoryError(f"cannot read inventory {path}: {reason}") from None
        self._devices = parse_inventory(document, simulated=True)
        self.description = f"simulated inventory from {path.name} (no GPU is used)"
        self._usage: dict[int, tuple[int, int, tuple[ProcessUsage, ...]]] = {}
        self._outside = _processes_outside_leases(document, path)
        self._host = _host_memory(document, path)
        try:  # the simulated checkpoint's restore fails for these (see SimulatedProcessControl)
            self.restore_fails = frozenset(int(pid) for pid in document.get("restore_fails", []))
        except (TypeError, ValueError) as exc:
            raise InventoryError(f"{path}: restore_fails must list process ids") from exc
        drain_ms = document.get("lock_drain_ms", 0)
        if isinstance(drain_ms, bool) or not isinstance(drain_ms, (int, float)):
            raise InventoryError(f"{path}: lock_drain_ms must be a number of milliseconds")
        if not 0 <= drain_ms <= 60_000:
            raise InventoryError(f"{path}: lock_drain_ms must be between 0 and 60000")
        self.lock_drain_s = drain_ms / 1000
        self._checkpointed: frozenset[int] = frozenset()

    def devices(self) -> list[DeviceInfo]:
        return list(self._devices)

    def set_usage(
        self, index: int, memory_used_mib: int, busy: bool, processes: tuple[ProcessUsage, ...] = ()
    ) -> None:
        self._usage[index] = (memory_used_mib, 100 if busy else 0, processes)

    def set_checkpointed(self, pids: frozenset[int]) -> None:
        """Processes whose device memory the simulated checkpoint moved to the host."""
        self._checkpointed = pids

    def host_memory(self) -> HostMemoryReading | None:
        return self._host or read_host_memory()

    def readings(self) -> list[DeviceReading]:
        out = []
        for device in self._devices:
            used, util, procs = self._usage.get(device.index, (0, 0, ()))
            outside = tuple(
                process
                for process in self._outside.get(device.index, ())
                if process.pid not in self._checkpointed
            )
            used += sum(process.used_mib for process in outside)
            procs = (*procs, *outside)
            out.append(
                DeviceReading(
                    index=device.index, memory_used_mib=used, utilization_pct=util, processes=procs
                )
            )
        return out

    def close(self) -> None:
        return None


class NvmlInventory:
    """A real host's GPUs, read through NVML (nvidia-ml-py).  Read-only by design."""

    kind = "nvml"

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError as exc:  # pragma: no cover - dependency of the package
            raise InventoryError("nvidia-ml-py is not installed") from exc
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise InventoryError(f"NVML did not initialise: {exc}") from exc
        self._nvml = pynvml
        self._handles = [
            pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
        ]
        if not self._handles:
            raise InventoryError("NVML initialised but reports no GPU")
        self._devices = [self._describe(i, h) for i, h in enumerate(self._handles)]
        driver = self._devices[0].driver_version
        self.description = f"NVML: {len(self._devices)} GPU(s), driver {driver}"

    def _call(self, fn, *args, default=None):
        try:
            return fn(*args)
        except (self._nvml.NVMLError, AttributeError, TypeError):
            return default

    def _describe(self, index: int, handle) -> DeviceInfo:
        nv = self._nvml
        name = nv.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else name
        uuid = nv.nvmlDeviceGetUUID(handle)
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        memory = nv.nvmlDeviceGetMemoryInfo(handle)
        # NVML gives SM counts for MIG devices and for GPU-instance profiles, not for a
        # whole GPU: the full-GPU profile (7g) has them all; CUDA is the last resort.
        get_attributes = getattr(nv, "nvmlDeviceGetAttributes_v2", None) or getattr(
            nv, "nvmlDeviceGetAttributes", None
        )
        attrs = self._call(get_attributes, handle, default=None) if get_attributes else None
        mp_count = int(getattr(attrs, "multiprocessorCount", 0) or 0)
        cc = self._call(nv.nvmlDeviceGetCudaComputeCapability, handle, default=(0, 0))
        driver = nv.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else driver
        mig = self._call(nv.nvmlDeviceGetMigMode, handle, default=(0, 0))
        compute_mode = self._call(nv.nvmlDeviceGetComputeMode, handle, default=0)
        profiles = self._profiles(handle)
        instances = self._instances(handle, profiles) if mig and mig[0] else ()
        if not mp_count:
            mp_count = max((p.multiprocessor_count for p in profiles), default=0)
        if not mp_count:
            mp_count = _cuda_multiprocessor_count(uuid)
        return DeviceInfo(
            index=index,
            name=name,
            uuid=uuid,
            memory_total_mib=int(memory.total // MIB),
            multiprocessor_count=int(mp_count),
            compute_capability=(int(cc[0]), int(cc[1])),
            driver_version=driver,
            mig_enabled=bool(mig[0]),
            mig_pending=bool(mig[1]),
            compute_mode=int(compute_mode),
            profiles=profiles,
            instances=instances,
        )

    def _profiles(self, handle) -> tuple[MigProfile, ...]:
        nv = self._nvml
        out = []
        for pid in range(getattr(nv, "NVML_GPU_INSTANCE_PROFILE_COUNT", 16)):
            info = self._call(nv.nvmlDeviceGetGpuInstanceProfileInfo, handle, pid, default=None)
            if info is None:
                continue
            # Placement rules come from the table of the 8-memory-slice parts: nvidia-ml-py's
            # nvmlDeviceGetGpuInstancePossiblePlacements wrapper differs between releases.
            slices, starts = _PLACEMENT_RULES.get(pid, (info.sliceCount, (0,)))
            out.append(
                MigProfile(
                    id=pid,
                    name=profile_name(pid, info.sliceCount, int(info.memorySizeMB)),
                    slice_count=int(info.sliceCount),
                    memory_mib=int(info.memorySizeMB),
                    multiprocessor_count=int(info.multiprocessorCount),
                    instance_count=int(info.instanceCount),
                    memory_slices=int(slices),
                    placements=tuple(starts),
                    media_extensions=pid in _MEDIA_EXTENSION_PROFILE_IDS,
                )
            )
        return tuple(out)

    def _instances(self, handle, profiles: tuple[MigProfile, ...]) -> tuple[MigInstance, ...]:
        nv = self._nvml
        by_id = {p.id: p for p in profiles}
        out = []
        count = self._call(nv.nvmlDeviceGetMaxMigDeviceCount, handle, default=0) or 0
        for slot in range(count):
            mig = self._call(nv.nvmlDeviceGetMigDeviceHandleByIndex, handle, slot, default=None)
            if mig is None:
                continue
            uuid = nv.nvmlDeviceGetUUID(mig)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            gi = self._call(nv.nvmlDeviceGetGpuInstanceId, mig, default=0)
            ci = self._call(nv.nvmlDeviceGetComputeInstanceId, mig, default=0)
            memory = nv.nvmlDeviceGetMemoryInfo(mig)
            attrs = self._call(nv.nvmlDeviceGetAttributes_v2, mig, default=None)
            gi_handle = self._call(nv.nvmlDeviceGetGpuInstanceById, handle, gi, default=None)
            gi_info = self._call(nv.nvmlGpuInstanceGetInfo, gi_handle, default=None)
            profile_id = int(gi_info.profileId) if gi_info is not None else -1
            profile = by_id.get(profile_id)
            out.append(
                MigInstance(
                    uuid=uuid,
                    profile_id=profile_id,
                    name=profile.name if profile else "unknown",
                    gpu_instance_id=int(gi),
                    compute_instance_id=int(ci),
                    memory_mib=int(memory.total // MIB),
                    multiprocessor_count=int(attrs.multiprocessorCount) if attrs else 0,
                    start=int(gi_info.placement.start) if gi_info is not None else 0,
                    size=int(gi_info.placement.size) if gi_info is not None else 1,
                )
            )
        return tuple(out)

    def devices(self) -> list[DeviceInfo]:
        return list(self._devices)

    def readings(self) -> list[DeviceReading]:
        nv = self._nvml
        out = []
        for device, handle in zip(self._devices, self._handles, strict=True):
            memory = self._call(nv.nvmlDeviceGetMemoryInfo, handle, default=None)
            util = self._call(nv.nvmlDeviceGetUtilizationRates, handle, default=None)
            if device.mig_enabled:
                processes = self._mig_processes(handle)
            else:
                procs = self._call(nv.nvmlDeviceGetComputeRunningProcesses, handle, default=[])
                processes = tuple(
                    ProcessUsage(pid=int(p.pid), used_mib=int((p.usedGpuMemory or 0) // MIB))
                    for p in procs or []
                )
            out.append(
                DeviceReading(
                    index=device.index,
                    memory_used_mib=int(memory.used // MIB) if memory else 0,
                    utilization_pct=int(util.gpu) if util else 0,
                    processes=processes,
                )
            )
        return out

    def _mig_processes(self, handle: object) -> tuple[ProcessUsage, ...]:
        """Per MIG instance, its processes (NVML answers per instance through the MIG
        device's own handle; the whole GPU's handle gives only an aggregate, and only to
        privileged callers)."""
        nv = self._nvml
        count = self._call(nv.nvmlDeviceGetMaxMigDeviceCount, handle, default=0) or 0
        found: list[ProcessUsage] = []
        for index in range(count):
            mig = self._call(nv.nvmlDeviceGetMigDeviceHandleByIndex, handle, index, default=None)
            if mig is None:
                continue  # no instance at that index
            uuid = self._call(nv.nvmlDeviceGetUUID, mig, default=None)
            procs = self._call(nv.nvmlDeviceGetComputeRunningProcesses, mig, default=[]) or []
            for p in procs:
                used = int((p.usedGpuMemory or 0) // MIB)
                found.append(ProcessUsage(pid=int(p.pid), used_mib=used, mig_uuid=uuid))
        return tuple(found)

    def host_memory(self) -> HostMemoryReading | None:
        return read_host_memory()

    def close(self) -> None:
        with contextlib.suppress(self._nvml.NVMLError):
            self._nvml.nvmlShutdown()


def _cuda_multiprocessor_count(uuid: str) -> int:
    """SM count through the CUDA driver (no context is created), 0 if that fails."""
    try:
        from cuda.bindings import driver as cu

        if cu.cuInit(0)[0] != cu.CUresult.CUDA_SUCCESS:
            return 0
        _, count = cu.cuDeviceGetCount()
        wanted = uuid.removeprefix("GPU-").replace("-", "").lower()
        for ordinal in range(count):
            _, device = cu.cuDeviceGet(ordinal)
            _, raw = cu.cuDeviceGetUuid(device)
            if bytes(raw.bytes).hex() == wanted:
                attribute = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
                return int(cu.cuDeviceGetAttribute(attribute, device)[1])
    except Exception:  # no CUDA here: the count stays unknown
        return 0
    return 0


# Device nodes the NVIDIA driver creates: where one exists, this is a GPU host.
NVIDIA_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0")


def open_inventory(spec: str | None) -> tuple[InventoryBackend, str | None]:
    """Open the inventory ``spec`` names: "auto", "nvml", a fixture name or a JSON path.

    Returns the backend and, when "auto" fell back to simulation, a sentence saying so.
    On a host with NVIDIA devices "auto" never simulates: NVML failing there is a broken
    driver or library, and a broker serving a pretend GPU would hide it.
    """
    if spec in (None, "", "auto"):
        try:
            return NvmlInventory(), None
        except InventoryError as exc:
            found = [node for node in NVIDIA_DEVICE_NODES if os.path.exists(node)]
            if found:
                raise InventoryError(
                    f"NVML failed on a host with NVIDIA devices ({found[0]}): {exc}; not "
                    "simulating a GPU here (fix the driver or nvidia-ml-py, or pass "
                    "--simulate h200 on purpose)"
                ) from None
            backend = SimulatedInventory("h200")
            return backend, f"no usable GPU ({exc}); simulating one H200 from the shipped readout"
    if spec == "nvml":
        return NvmlInventory(), None
    return SimulatedInventory(spec), None
