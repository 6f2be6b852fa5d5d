"""An optimizer's state kept in host memory: what lets a model whose weights alone nearly fill the GPU train.

At the Llama-3.1-8B shape the bf16 weights take 16 GB and even 8-bit AdamW moments another 16 GB, so a 24 GB
GPU holds the weights but not the state. `HostState` keeps each parameter's state tensors in host memory
(pinned, so that the copies are asynchronous DMA) and, for that parameter's update, copies them into device
buffers that every parameter reuses (sized to the largest), runs the update there and copies them back. All of
it is queued on the current stream, in order: a buffer is overwritten by the next parameter's state only after
the copy-back of the last one has read it, and the host never waits, except `synchronize` before the host
copies are read (a checkpoint). The update is the same kernel launch on the same values and random bits, so
the results are bit-identical to keeping the state on the device (tests/kernels/test_host_state.py). The cost
is the host link: each step moves the whole state in and out (about 32 GB at 8B with 8-bit moments, 1.3 s at
the 25 GB/s a PCIe Gen5 x16 link gives in practice), which the memory planner counts.
"""

from __future__ import annotations

import torch


class HostState:
    """The state tensors named `names` of each parameter in host memory, staged on the device one at a time."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def keep(self, state: dict[str, torch.Tensor]) -> None:
        """Move `state`'s tensors to host memory (pinned when there is a GPU), in place of the dict's entries."""
        pin = torch.cuda.is_available()
        for name in self.names:
            tensor = state[name]
            if tensor.device.type == "cpu" and (tensor.is_pinned() or not pin):
                continue
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
            host.copy_(tensor)
            state[name] = host

    def stage(self, state: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
        """Device copies of `state`'s tensors (views of the shared buffers), their copies queued."""
        staged = {}
        for name in self.names:
            host = state[name]
            key = (name, host.dtype, device)
            buffer = self._buffers.get(key)
            if buffer is None or buffer.numel() < host.numel():
                # Grows to the largest parameter's size once; the old buffer is freed after its last queued use.
                buffer = torch.empty(host.numel(), dtype=host.dtype, device=device)
                self._buffers[key] = buffer
            view = buffer[: host.numel()].view(host.shape)
            view.copy_(host, non_blocking=True)
            staged[name] = view
        return staged

    def unstage(self, state: dict[str, torch.Tensor], staged: dict[str, torch.Tensor]) -> None:
        """Queue the copies of the updated `staged` tensors back into `state`'s host tensors."""
        for name in self.names:
            state[name].copy_(staged[name], non_blocking=True)

    @staticmethod
    def synchronize() -> None:
        """Wait for the queued copies back to host memory (before the host tensors are read)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def device_bytes(self) -> int:
        """Bytes of the device buffers (what the state costs on the GPU)."""
        return sum(buffer.numel() * buffer.element_size() for buffer in self._buffers.values())
