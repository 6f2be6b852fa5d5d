"""What the launchers of several ops ask of the device and of their tensors: the device's multiprocessor
count (programs per SM size persistent grids) and whether two tensors share bytes of memory (a backward may
write gradients over its saved inputs only where they do not)."""

import functools

import torch


@functools.cache
def _cuda_multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def multiprocessor_count(device: torch.device, interpreter_count: int) -> int:
    """SMs of a CUDA device; `interpreter_count`, each op's small stand-in, for CPU tensors run by the Triton
    interpreter."""
    if device.type != "cuda":
        return interpreter_count
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_multiprocessor_count(index)


def _storage_span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1
    return start, start + extent * t.element_size()


def storage_overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges `a` and `b` span in one storage intersect."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = _storage_span(a), _storage_span(b)
    return a0 < b1 and b0 < a1
