"""Slots of the KDA state pool: one per running request, holding its conv windows and recurrent state."""

from __future__ import annotations


class StateSlotPool:
    """Hands out slot indices [0, num_slots); the worker's state tensors are indexed by them."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots} must be at least 1")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._owner: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def slot_of(self, request_id: str) -> int | None:
        return self._owner.get(request_id)

    def allocate(self, request_id: str) -> int | None:
        """The request's slot (a new one on first call), or None when the pool is empty."""
        if request_id in self._owner:
            return self._owner[request_id]
        if not self._free:
            return None
        slot = self._free.pop()
        self._owner[request_id] = slot
        return slot

    def free(self, request_id: str) -> None:
        slot = self._owner.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
