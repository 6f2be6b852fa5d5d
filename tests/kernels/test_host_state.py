"""The fused optimizers with their state in host memory (fusetune/kernels/host_state.py): bit-identical weights
and state to the same optimizer with its state on the device, whole steps and one parameter at a time (the
optimizer step inside the backward), across a checkpoint; the state's tensors stay in host memory and the device
holds one set of buffers the size of the largest parameter's state.

On CPU the Triton kernels run under TRITON_INTERPRET=1, and "host" and "device" are the same memory: the staging
runs (buffers, copies in and out, one launch per parameter) and must change nothing. On a GPU the test also
checks that the state is in pinned host memory and what the device holds.
"""

from __future__ import annotations

import io

import pytest
import torch

from fusetune.kernels import FusedAdamW, FusedAdamW8bit, gradient_clipping_scale

SHAPES = [(300,), (33, 17), (700,)]  # the largest last: the buffers grow once
HYPERPARAMETERS = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
OPTIMIZERS = {
    "bf16-sr": (FusedAdamW, {}, ("exp_avg", "exp_avg_sq")),
    "8bit": (
        FusedAdamW8bit,
        {"block_size": 256},
        ("exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales"),
    ),
}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _params(device):
    generator = torch.Generator().manual_seed(1)
    return [
        torch.nn.Parameter(torch.randn(shape, generator=generator).to(torch.bfloat16).to(device))
        for shape in SHAPES
    ]


def _gradients(params, step):
    generator = torch.Generator().manual_seed(100 + step)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator).to(torch.bfloat16).to(param.device)


def _train(kind, device, *, on_host, steps=3, one_at_a_time=False):
    cls, options, _ = OPTIMIZERS[kind]
    params = _params(device)
    groups = [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}]
    optimizer = cls(groups, **HYPERPARAMETERS, seed=3, state_on_host=on_host, **options)
    scale = gradient_clipping_scale(torch.tensor(2.0, device=device), 1.0)  # halves every gradient
    for step in range(steps):
        _gradients(params, step)
        if one_at_a_time:
            for param in reversed(params):  # as the backward completes them
                optimizer.step(grad_scale=scale, params=(param,))
        else:
            optimizer.step(grad_scale=scale)
    return params, optimizer


def _assert_same(first, second, names):
    (params_a, optimizer_a), (params_b, optimizer_b) = first, second
    for a, b in zip(params_a, params_b, strict=True):
        assert torch.equal(a, b)
        state_a, state_b = optimizer_a.state[a], optimizer_b.state[b]
        for name in names:
            assert torch.equal(state_a[name].cpu(), state_b[name].cpu()), name
        assert float(state_a["step"]) == float(state_b["step"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_state_in_host_memory_gives_the_same_weights_and_state(kind, device):
    names = OPTIMIZERS[kind][2]
    on_device = _train(kind, device, on_host=False)
    on_host = _train(kind, device, on_host=True)
    _assert_same(on_device, on_host, names)
    # One parameter at a time, as the optimizer step inside the backward runs it: the same again.
    _assert_same(on_device, _train(kind, device, on_host=True, one_at_a_time=True), names)
    params, optimizer = on_host
    largest = max(param.numel() for param in params)
    for param in params:
        for name in names:
            host = optimizer.state[param][name]
            assert host.device.type == "cpu"
            assert host.is_pinned() == torch.cuda.is_available()
    # The device holds one buffer per state tensor, the size of the largest parameter's.
    buffers = optimizer.host_state._buffers
    assert {name for name, _, _ in buffers} == set(names)
    assert all(b.device.type == device for b in buffers.values())
    largest_state = {name: optimizer.state[params[-1]][name].numel() for name in names}
    assert {name: b.numel() for (name, _, _), b in buffers.items()} == largest_state
    assert params[-1].numel() == largest


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_a_checkpoint_moves_between_host_and_device_state(kind):
    """A device-state run's checkpoint resumes in a host-state optimizer (and back) on the same curve."""
    names = OPTIMIZERS[kind][2]
    straight = _train(kind, "cpu", on_host=False, steps=4)
    for first_on_host in (False, True):
        params, optimizer = _train(kind, "cpu", on_host=first_on_host, steps=2)
        buffer = io.BytesIO()
        torch.save(([p.detach().clone() for p in params], optimizer.state_dict()), buffer)
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
        _assert_same(straight, _continue_from(kind, saved, on_host=not first_on_host), names)


def _continue_from(kind, saved, *, on_host):
    """Steps 2 and 3 (the straight run's gradients) from the weights and optimizer state `saved` after step 1."""
    cls, options, _ = OPTIMIZERS[kind]
    params = _params("cpu")
    groups = [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}]
    optimizer = cls(groups, **HYPERPARAMETERS, seed=3, state_on_host=on_host, **options)
    for param, weights in zip(params, saved[0], strict=True):
        param.data.copy_(weights)
    optimizer.load_state_dict(saved[1])
    scale = gradient_clipping_scale(torch.tensor(2.0), 1.0)
    for step in (2, 3):
        _gradients(params, step)
        optimizer.step(grad_scale=scale)
    return params, optimizer


def test_fsdp_dtensors_are_refused_with_the_reason():
    class FakeDTensor(torch.nn.Parameter):
        def to_local(self):
            return self

    param = FakeDTensor(torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="FSDP2 already shards the state"):
        FusedAdamW([param], state_on_host=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_loading_a_checkpoint_puts_the_state_in_host_memory_without_the_gpu(kind):
    """A resume on a GPU that holds the weights but not the state: the load never brings the state onto it."""
    params, optimizer = _train(kind, "cuda", on_host=False, steps=1)
    saved = optimizer.state_dict()  # as a checkpoint reads back: the tensors on the host
    saved["state"] = {i: {k: v.cpu() for k, v in s.items()} for i, s in saved["state"].items()}
    cls, options, names = OPTIMIZERS[kind]
    groups = [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}]
    fresh = cls(groups, **HYPERPARAMETERS, seed=3, state_on_host=True, **options)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fresh.load_state_dict(saved)
    assert torch.cuda.max_memory_allocated() == before
    assert all(fresh.state[p][name].is_pinned() for p in params for name in names)


@pytest.mark.parametrize("on_host", [False, True], ids=["state-on-device", "state-on-host"])
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_the_trainer_restores_a_fused_optimizer_without_stepping_it(kind, on_host, monkeypatch):
    """The checkpointer makes the state with `initialize_state` before torch's loader, which would otherwise
    step the optimizer on zero gradients of every parameter at once (as much memory again as the weights), and
    the state it loads is the one saved."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from fusetune.worker.train.checkpoints import checkpointer

    cls, options, names = OPTIMIZERS[kind]
    model = torch.nn.Sequential(torch.nn.Linear(32, 16, bias=False), torch.nn.Linear(16, 8, bias=False))
    model.to(torch.bfloat16)
    trained = cls(model.parameters(), **HYPERPARAMETERS, seed=3, **options)
    _gradients(list(model.parameters()), 0)
    trained.step()
    saved = get_optimizer_state_dict(model, trained, options=checkpointer.FULL_STATE_ON_EVERY_RANK)
    fresh = cls(model.parameters(), **HYPERPARAMETERS, seed=3, state_on_host=on_host, **options)
    steps = []
    monkeypatch.setattr(fresh, "step", lambda *args, **kwargs: steps.append(1))
    monkeypatch.setattr(checkpointer.state, "read_optimizer_state", lambda path: saved)
    checkpointer.Checkpointer.restore_optimizer(None, model, fresh, "unused")
    assert steps == []
    for param in model.parameters():
        for name in names:
            assert torch.equal(fresh.state[param][name].cpu(), trained.state[param][name].cpu()), name
        assert float(fresh.state[param]["step"]) == 1.0
