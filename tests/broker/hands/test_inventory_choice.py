"""Which inventory a broker serves when none is named: NVML, or a simulated H200 that
says so, but never a simulated GPU on a host whose NVIDIA devices NVML cannot read."""

from __future__ import annotations

import pytest

from gpushare_ext.broker.hands import inventory
from gpushare_ext.broker.hands.inventory import InventoryError, NvmlInventory, open_inventory


def _nvml_fails(*_: object) -> None:
    raise InventoryError("NVML did not initialise: Driver Not Loaded")


def test_without_nvidia_devices_auto_simulates_and_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(NvmlInventory, "__init__", _nvml_fails)
    monkeypatch.setattr(inventory, "NVIDIA_DEVICE_NODES", (str(tmp_path / "nvidiactl"),))
    backend, note = open_inventory("auto")
    assert backend.kind == "simulated"
    assert note == (
        "no usable GPU (NVML did not initialise: Driver Not Loaded); simulating one H200 "
        "from the shipped readout"
    )


def test_on_a_gpu_host_a_failing_nvml_is_an_error_not_a_simulated_gpu(monkeypatch, tmp_path):
    node = tmp_path / "nvidiactl"
    node.touch()
    monkeypatch.setattr(NvmlInventory, "__init__", _nvml_fails)
    monkeypatch.setattr(inventory, "NVIDIA_DEVICE_NODES", (str(node),))
    with pytest.raises(InventoryError, match="NVML failed on a host with NVIDIA devices"):
        open_inventory("auto")
    # Asked for on purpose, the simulation is still there.
    assert open_inventory("h200")[0].kind == "simulated"
