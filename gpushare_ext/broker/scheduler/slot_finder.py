"""Which slots a request may use: its device wish, its slice wish, the GPUs it can reach.

What it is for: :class:`SlotFinder` knows the host's devices and slots (whole GPUs, or
MIG instances) and which devices an admin drained; it turns a request's wishes into the
slots it may be placed on, or the sentence that says why there are none.  The slots
never change while the scheduler lives, so the answers are remembered.

What it must not do: look at leases or memory (whether a lease fits a slot is the
placement's question), or change anything but the drained devices.
"""

from __future__ import annotations

from gpushare_ext.broker.scheduler.actions import Action
from gpushare_ext.broker.scheduler.events import DeviceDrained
from gpushare_ext.broker.scheduler.scheduler_records import Lease, SchedulerError, Slot, slots_of
from gpushare_ext.devices import DeviceInfo
from gpushare_ext.protocol import ErrorCode, LeaseState, SliceWish

CANDIDATE_MEMO = 256  # device wishes whose matching slots are remembered


class SlotFinder:
    """The host's slots, and which of them a request's wishes name."""

    def __init__(self, devices: list[DeviceInfo]) -> None:
        self.devices = {d.index: d for d in devices}
        self.slots: dict[str, Slot] = {}
        self.drained: set[int] = set()
        for device in devices:
            for slot in slots_of(device):
                self.slots[slot.key] = slot
        self._candidates: dict[
            tuple[str, SliceWish, tuple[str, ...] | None], tuple[list[str], str]
        ] = {}

    def on_device_drained(self, event: DeviceDrained, now: float) -> list[Action]:
        if event.device_index not in self.devices:
            raise SchedulerError(ErrorCode.INVALID, f"there is no device {event.device_index}")
        if event.drained:
            self.drained.add(event.device_index)
        else:
            self.drained.discard(event.device_index)
        return []

    def slots_of_device(self, index: int) -> list[Slot]:
        return [s for s in self.slots.values() if s.device_index == index]

    def is_drained(self, key: str) -> bool:
        return self.slots[key].device_index in self.drained

    def not_drained(self, keys: list[str]) -> list[str]:
        return [k for k in keys if self.slots[k].device_index not in self.drained]

    def wanted_slots(self, lease: Lease) -> list[str]:
        """The slots a waiter may run on: its own if it holds one, else those it fits."""
        if lease.slot is not None:
            return [lease.slot]
        candidates, _ = self.candidate_slots(lease.device_wish, lease.slice, lease.reachable)
        return [k for k in candidates if self.slots[k].memory_bytes >= lease.memory_bytes]

    def placeable_slots(self, lease: Lease, wanted: list[str]) -> list[str]:
        """Of ``wanted``, those a waiter may be placed on now: a queued request not on a
        drained device (a paused lease resumes where it holds its memory)."""
        return [
            k
            for k in wanted
            if self.slots[k].device_index not in self.drained or lease.state != LeaseState.QUEUED
        ]

    def candidate_slots(
        self, device_wish: str, wish: SliceWish, reachable: tuple[str, ...] | None = None
    ) -> tuple[list[str], str]:
        """Slots a request may be placed on (only on GPUs its process can reach), or
        ([], why none)."""
        # The slots never change while the scheduler lives, and every waiter asks this on
        # every event.  Device wishes are the clients' text: the memo stays small.
        memo_key = (device_wish, wish, reachable)
        known = self._candidates.get(memo_key)
        if known is None:
            if len(self._candidates) >= CANDIDATE_MEMO:
                self._candidates.clear()
            known = self._match_slots(device_wish, wish)
            if reachable is not None and known[0]:
                known = self.only_reachable(known[0], reachable)
            self._candidates[memo_key] = known
        return list(known[0]), known[1]

    def only_reachable(self, keys: list[str], reachable: tuple[str, ...]) -> tuple[list[str], str]:
        """``keys`` on GPUs the process can reach (by GPU or MIG UUID, or host index), or
        ([], why none): a pod given some of the node's GPUs cannot use the others."""
        names = set(reachable)
        kept = [
            k
            for k in keys
            if {self.slots[k].device_uuid, self.slots[k].mig_uuid, str(self.slots[k].device_index)}
            & names
        ]
        if kept:
            return kept, ""
        seen = ", ".join(reachable[:4]) + (" ..." if len(reachable) > 4 else "") or "none"
        return [], (
            f"this session's process can reach none of the GPUs that match (it sees {seen}; "
            "its container was given other GPUs than this broker's, or none)"
        )

    def reachable_note(self, lease: Lease) -> str:
        """For status and the queue line: which GPUs a restricted session may use ("" when
        it may use every one this broker manages)."""
        if lease.reachable is None:
            return ""
        keys, _ = self.candidate_slots(lease.device_wish, lease.slice, lease.reachable)
        every, _ = self.candidate_slots(lease.device_wish, lease.slice)
        if set(keys) == set(every):
            return ""
        devices = sorted({self.slots[k].device_index for k in keys})
        named = ", ".join(f"GPU {index}" for index in devices)
        return f"this session's process can use only {named}"

    def _match_slots(self, device_wish: str, wish: SliceWish) -> tuple[list[str], str]:
        keys, matching, refusal = self._slots_for_device(device_wish)
        if refusal:
            return [], refusal
        # MIG on but nothing cut yet: say so whatever the wish (only an admin can fix it).
        mig_without_instances = [
            i for i in matching if self.devices[i].mig_enabled and not self.devices[i].instances
        ]
        no_instance_yet = (
            f"MIG is on for device(s) {mig_without_instances} but no instance exists; "
            "an admin can create some (gpushare mig plan)"
        )
        if wish == SliceWish.MIG:
            keys = [k for k in keys if self.slots[k].mig_uuid]
            if not keys and not mig_without_instances:
                return [], "no MIG instance exists on the matching devices (MIG is off)"
        elif wish == SliceWish.SHARED:
            keys = [k for k in keys if not self.slots[k].mig_uuid]
            if not keys and any(self.devices[i].instances for i in matching):
                return [], "the matching devices are cut into MIG instances; ask for mig"
            if not keys:
                return [], no_instance_yet
        if not keys:
            return [], no_instance_yet if mig_without_instances else "no device matches"
        return keys, ""

    def _slots_for_device(self, device_wish: str) -> tuple[list[str], list[int], str]:
        """(slot keys, device indices) a device wish (auto, an index, a UUID) names, or a
        refusal when it names nothing."""
        keys = sorted(self.slots)
        matching = sorted(self.devices)
        wish_text = (device_wish or "auto").strip()
        if wish_text == "auto":
            return keys, matching, ""
        # isdigit() is true for "²" and "①", which int() refuses: ASCII digits only.
        if wish_text.isascii() and wish_text.isdecimal():
            index = int(wish_text)
            if index not in self.devices:
                return [], [], f"there is no device {index} (devices: {sorted(self.devices)})"
            return [k for k in keys if self.slots[k].device_index == index], [index], ""
        keys = [k for k in keys if wish_text in (self.slots[k].mig_uuid, self.slots[k].device_uuid)]
        matching = [i for i, d in self.devices.items() if d.uuid == wish_text]
        if not keys and not matching:
            return [], [], f"no device or MIG instance has the UUID {wish_text}"
        return keys, matching, ""
