"""A session whose container sees only some of the node's GPUs gets leases only there.

On a multi-GPU Kubernetes node the device plugin gives a pod only the GPUs it allocated
(``NVIDIA_VISIBLE_DEVICES``); the runtime names them in its hello, and the broker places
that session's leases only there, says so while it waits, and refuses in one line when
it can reach none.  Against a real broker subprocess on the simulated two-GPU H200
inventory, plus the runtime's reading of the variable.
"""

from __future__ import annotations

import pytest

from gpushare_ext.client import BrokerClient
from gpushare_ext.protocol import Granted, LeaseState, Queued, Refused
from gpushare_ext.runtime.binding import visible_gpus

GPU0 = "GPU-00000000-0000-0000-0000-000000000000"
GPU1 = "GPU-00000000-0000-0000-0000-000000000001"
EXCLUSIVE = '[broker]\nsharing = "exclusive"\n'
GIB = 1 << 30


@pytest.fixture
def two_gpus(start_broker):
    return start_broker(simulate="h200-x2", config_toml=EXCLUSIVE).socket


def test_leases_of_a_session_that_sees_one_gpu_go_only_there(two_gpus):
    with (
        BrokerClient(two_gpus, visible_devices=[GPU1]) as first,
        BrokerClient(two_gpus, visible_devices=[GPU1]) as second,
        BrokerClient(two_gpus) as anyone,
    ):
        granted = first.request_lease(priority=150, memory_bytes=GIB)
        assert isinstance(granted, Granted) and granted.placement.device_index == 1
        # GPU 0 is free, but this session's process cannot reach it: it waits for GPU 1.
        waiting = second.request_lease(priority=150, memory_bytes=GIB)
        assert isinstance(waiting, Queued), waiting
        assert "this session's process can use only GPU 1" in waiting.reason
        (shown,) = [lease for lease in anyone.status().leases if lease.lease_id == waiting.lease_id]
        assert shown.state == LeaseState.QUEUED
        assert "can use only GPU 1" in shown.reason  # gpushare status says so
        # A session that sees every GPU is placed on the free one at once.
        other = anyone.request_lease(priority=150, memory_bytes=GIB)
        assert isinstance(other, Granted) and other.placement.device_index == 0


def test_a_host_index_names_a_gpu_too(two_gpus):
    with BrokerClient(two_gpus, visible_devices=["1"]) as client:
        granted = client.request_lease(priority=150, memory_bytes=GIB)
        assert isinstance(granted, Granted) and granted.placement.device_index == 1


@pytest.mark.parametrize("visible", [["GPU-not-on-this-node"], []])
def test_a_session_that_can_reach_none_of_the_gpus_is_refused_in_one_line(two_gpus, visible):
    with BrokerClient(two_gpus, visible_devices=visible) as client:
        refused = client.request_lease(priority=150, memory_bytes=GIB)
    assert isinstance(refused, Refused)
    assert "can reach none of the GPUs" in refused.message and "\n" not in refused.message


def test_a_device_the_session_cannot_reach_is_refused_even_when_asked_for_by_index(two_gpus):
    with BrokerClient(two_gpus, visible_devices=[GPU1]) as client:
        refused = client.request_lease(priority=150, memory_bytes=GIB, device="0")
    assert isinstance(refused, Refused) and "can reach none" in refused.message


@pytest.mark.parametrize(
    ("value", "seen"),
    [
        (None, None),
        ("all", None),
        ("", None),
        ("void", []),
        ("none", []),
        (f"{GPU1}", [GPU1]),
        (f" {GPU0} , MIG-abc ", [GPU0, "MIG-abc"]),
        ("0,1", ["0", "1"]),
    ],
)
def test_the_runtime_reads_what_the_device_plugin_gave_its_container(value, seen):
    environ = {} if value is None else {"NVIDIA_VISIBLE_DEVICES": value}
    assert visible_gpus(environ) == seen


def test_the_volume_mount_strategy_lists_the_gpus_as_files(tmp_path, monkeypatch):
    from gpushare_ext.runtime import binding

    folder = tmp_path / "nvidia-container-devices"
    folder.mkdir()
    (folder / GPU1).touch()
    monkeypatch.setattr(binding, "CONTAINER_DEVICES_DIR", str(folder))
    assert visible_gpus({"NVIDIA_VISIBLE_DEVICES": str(folder)}) == [GPU1]
