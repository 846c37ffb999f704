"""The bytes behind KDA state checkpoints: a pool of fixed-size units, and the copies between them and
the state slots of the KDA layers.

An image is every KDA layer's conv window then recurrent state, back to back, as raw bytes; it is
cut into `unit_bytes` pieces stored in the units the scheduler chose (not necessarily contiguous).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deltaserve.core.scheduler_output import SchedulerOutput


class StateCheckpointStore:
    """Owns the unit buffer [num_units, unit_bytes] (uint8) and moves images in and out of slots."""

    def __init__(self, state_tensors: list[torch.Tensor], num_units: int, unit_bytes: int) -> None:
        """state_tensors: per KDA layer, its conv state [S, D, W-1] and recurrent state [S, H, K, V]."""
        self.state_tensors = state_tensors
        self.unit_bytes = unit_bytes
        self.image_bytes = sum(t[0].numel() * t.element_size() for t in state_tensors)
        self.offsets = []  # where each tensor's slot bytes start in an image
        offset = 0
        for t in state_tensors:
            self.offsets.append(offset)
            offset += t[0].numel() * t.element_size()
        device = state_tensors[0].device if state_tensors else torch.device("cpu")
        self.units = torch.zeros(num_units, unit_bytes, dtype=torch.uint8, device=device)

    def _slot_bytes(self, slot: int) -> list[torch.Tensor]:
        return [t[slot].view(torch.uint8).reshape(-1) for t in self.state_tensors]

    def save(self, slot: int, unit_ids: list[int]) -> None:
        """Write the image of state slot `slot` into units `unit_ids`."""
        image = torch.cat(self._slot_bytes(slot))
        padded = image.new_zeros(len(unit_ids) * self.unit_bytes)
        padded[: image.numel()] = image
        index = self._index(unit_ids)
        self.units.index_copy_(0, index, padded.view(len(unit_ids), self.unit_bytes))

    def save_part(self, tensor_index: int, slot: int, unit_ids: tuple[int, ...] | list[int]) -> None:
        """Write one tensor's share of slot `slot`'s image (state_tensors[tensor_index]) into units
        `unit_ids`, where `save` would put it: a KDA layer captures its conv window and its recurrent
        state at a checkpoint inside a prefill chunk, each when that layer has computed it."""
        part = self.state_tensors[tensor_index][slot].view(torch.uint8).reshape(-1)
        done, start = 0, self.offsets[tensor_index]
        while done < part.numel():
            unit, inner = divmod(start + done, self.unit_bytes)
            n = min(part.numel() - done, self.unit_bytes - inner)
            self.units[unit_ids[unit], inner : inner + n].copy_(part[done : done + n])
            done += n

    def load(self, unit_ids: list[int], slot: int) -> None:
        """Overwrite state slot `slot` with the image held in units `unit_ids`."""
        index = self._index(unit_ids)
        image = self.units.index_select(0, index).reshape(-1)
        offset = 0
        for piece in self._slot_bytes(slot):
            piece.copy_(image[offset : offset + piece.numel()])
            offset += piece.numel()

    def _index(self, unit_ids: list[int]) -> torch.Tensor:
        """[len(unit_ids)] long on the units' device, sent without waiting for the device (pinned)."""
        index = torch.tensor(unit_ids, dtype=torch.long)
        if self.units.is_cuda:
            index = index.pin_memory()
        return index.to(self.units.device, non_blocking=True)

    def copy(self, src_slot: int, dst_slot: int) -> None:
        for t in self.state_tensors:
            t[dst_slot].copy_(t[src_slot])

    def before_forward(self, scheduler_output: SchedulerOutput, between: Callable[[], None] | None = None) -> None:
        """The step's saves_before, then `between` (the offload tier's saves and loads), then its loads."""
        for save in scheduler_output.state_saves_before:
            self.save(save.state_slot, save.unit_ids)
        if between is not None:
            between()
        for load in scheduler_output.state_loads:
            self.load(load.unit_ids, load.state_slot)

    def after_forward(self, scheduler_output: SchedulerOutput) -> None:
        for save in scheduler_output.state_saves_after:
            self.save(save.state_slot, save.unit_ids)
        for copy in scheduler_output.state_copies_after:
            self.copy(copy.src_slot, copy.dst_slot)
