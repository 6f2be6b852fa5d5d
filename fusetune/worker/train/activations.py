"""Activation memory by the decoder layer: some layers recompute their activations in the backward, some keep
them in pinned host memory until the backward needs them, the rest keep them on the GPU.

Recompute uses the model's own checkpointing (transformers' `GradientCheckpointingLayer`: checkpointing is
switched on for the model, then off again on every layer the plan keeps), so what a patched layer saves (the
fused MLP's few tensors) is what it recomputes. The layers recomputed are the cheapest to recompute first: a
layer with a sliding window (`config.layer_types`) does less attention work than one attending to the whole
row; among equals the last layers, since offload takes the first ones.

Offload takes the first layers: their activations wait longest for the backward, so the copies back have the
most time to overlap with compute. Each tensor a layer saves for its backward (large, contiguous, and not a
parameter) is copied to pinned host memory on a side stream as soon as it is saved, and its GPU memory is
released once that copy is done (`record_stream`). In the backward, the first tensor read of an offloaded
layer starts the copies back of the previous offloaded layer's tensors on the side stream, so that one layer's
copies overlap the backward of the layer after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

# Saved tensors smaller than this stay on the GPU: a copy's fixed cost outweighs the memory it frees.
MIN_OFFLOAD_BYTES = 1 << 20


@dataclass(frozen=True)
class ActivationLayout:
    """Which decoder layers (indices in forward order) recompute and which offload."""

    n_layers: int
    recomputed: tuple[int, ...]
    offloaded: tuple[int, ...]


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers in forward order (transformers' checkpointable layers), a PEFT wrapper or a
    distributed wrapper included."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]


def recompute_order(n_layers: int, layer_types: Sequence[str] | None) -> list[int]:
    """Layer indices, cheapest to recompute first: sliding-window layers before full-attention ones, the last
    layers first among equals."""
    types = list(layer_types or [])
    if len(types) != n_layers:
        types = ["full_attention"] * n_layers
    return sorted(range(n_layers), key=lambda i: (0 if "sliding" in str(types[i]) else 1, -i))


def plan_layout(
    n_layers: int, recompute_layers: int, offload_layers: int, layer_types=None
) -> ActivationLayout:
    if recompute_layers < 0 or offload_layers < 0:
        raise ValueError("recompute_layers and offload_layers count layers: they cannot be negative")
    if recompute_layers + offload_layers > n_layers:
        raise ValueError(
            f"recompute_layers ({recompute_layers}) + offload_layers ({offload_layers}) is more than the model's "
            f"{n_layers} decoder layers"
        )
    offloaded = tuple(range(offload_layers))
    recomputed = tuple(
        sorted([i for i in recompute_order(n_layers, layer_types) if i >= offload_layers][:recompute_layers])
    )
    return ActivationLayout(n_layers, recomputed, offloaded)


def apply_activation_layout(
    model: torch.nn.Module, recompute_layers: int, offload_layers: int
) -> tuple[ActivationLayout, ActivationOffload | None]:
    """Set up recompute and offload on `model`'s decoder layers; returns the layout and the offloader (None when
    nothing is offloaded). A model without checkpointable layers takes neither (ValueError)."""
    layers = decoder_layers(model)
    if not layers and (recompute_layers or offload_layers):
        raise ValueError(
            f"{type(model).__name__} has no decoder layers that can recompute or offload their activations"
        )
    config = getattr(model, "config", None)
    layout = plan_layout(len(layers), recompute_layers, offload_layers, getattr(config, "layer_types", None))
    if layout.recomputed:
        if not getattr(model, "is_gradient_checkpointing", False):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for index, layer in enumerate(layers):
            layer.gradient_checkpointing = index in layout.recomputed
    offload = ActivationOffload([layers[i] for i in layout.offloaded]) if layout.offloaded else None
    return layout, offload


class _Offloaded:
    """One saved tensor in pinned host memory, and its copy back once the backward asks for it."""

    __slots__ = ("host", "device", "back", "ready")

    def __init__(self, host: torch.Tensor, device: torch.device) -> None:
        self.host = host
        self.device = device
        self.back: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None

    def fetch(self, stream: torch.cuda.Stream) -> None:
        """Start the copy back on `stream` (the caller's stream waits for it in `tensor`)."""
        if self.back is not None:
            return
        with torch.cuda.stream(stream):
            self.back = self.host.to(self.device, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record(stream)

    def tensor(self, stream: torch.cuda.Stream) -> torch.Tensor:
        """The tensor back on the GPU, for the current stream (copied now if no prefetch started it; the copy
        runs on `stream` either way, after the copy out that the same stream made)."""
        self.fetch(stream)
        assert self.back is not None and self.ready is not None
        current = torch.cuda.current_stream(self.device)
        current.wait_event(self.ready)
        back, self.back, self.ready = self.back, None, None
        back.record_stream(current)  # allocated on the side stream, used on this one
        return back


class ActivationOffload:
    """Saved-tensor hooks entered around the forward of each offloaded layer (see the module docstring)."""

    def __init__(self, layers: Sequence[torch.nn.Module]) -> None:
        self.layers = list(layers)
        self._stream: torch.cuda.Stream | None = None
        self._parameter_storages: set[int] = set()
        # Per offloaded layer, in forward order: what it saved in the current step.
        self._saved: list[list[_Offloaded]] = [[] for _ in self.layers]
        self._active: Any = None
        self._handles = []
        for position, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(self._enter(position)))
            self._handles.append(layer.register_forward_hook(self._exit))

    def _enter(self, position: int):
        def hook(module: torch.nn.Module, args: Any) -> None:
            if not (module.training and torch.is_grad_enabled()):
                return
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            if not self._parameter_storages:
                self._parameter_storages = {
                    p.untyped_storage().data_ptr() for layer in self.layers for p in layer.parameters()
                }
            self._saved[position] = []
            context = torch.autograd.graph.saved_tensors_hooks(
                lambda t: self._pack(t, position), lambda packed: self._unpack(packed, position)
            )
            context.__enter__()
            self._active = context

        return hook

    def _exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._active is not None:
            self._active.__exit__(None, None, None)
            self._active = None

    def _pack(self, tensor: torch.Tensor, position: int) -> Any:
        if (
            tensor.device.type != "cuda"
            or tensor.numel() * tensor.element_size() < MIN_OFFLOAD_BYTES
            or not tensor.is_contiguous()
            or tensor.untyped_storage().data_ptr() in self._parameter_storages
        ):
            return tensor
        assert self._stream is not None
        self._stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(self._stream):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
        # The GPU memory goes back to the allocator only once the side stream's copy is done.
        tensor.record_stream(self._stream)
        offloaded = _Offloaded(host, tensor.device)
        self._saved[position].append(offloaded)
        return offloaded

    def _unpack(self, packed: Any, position: int) -> torch.Tensor:
        if not isinstance(packed, _Offloaded):
            return packed
        assert self._stream is not None
        # The backward has reached this layer: bring the previous offloaded layer's tensors back meanwhile.
        if position > 0:
            for earlier in self._saved[position - 1]:
                earlier.fetch(self._stream)
        return packed.tensor(self._stream)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
