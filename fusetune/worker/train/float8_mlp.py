"""The fp8 mode's gated MLP as one autograd node: down(act(gate(x)) * up(x)) with its three matmuls in float8
(tensorwise, as torchao's Float8Linear computes them) and the gated activation's backward writing its gradients
straight into float8 (fusetune.kernels.float8_gated).

Left to the three Float8Linear modules, the backward of a compiled layer materialised the activation's
gradients in bf16 or fp32 before torchao's casts read them: at the Gemma-2-2B shape, 8 x 2,048 tokens, the MLP's
backward held 1.54 GB of [tokens, intermediate] buffers at the step's memory peak, 0.84 GB of them for d gate
alone (h200-step.md, e2e-fp8-gemma-backward-peak), and the fp8 mode's peak stood 1.2 GB above bf16's. Here it
holds the incoming gradient, the saved gate and up, and the five float8 tensors the matmuls read.

The node computes what the modules compute, bit for bit in eager mode: the same casts of x, the weights, hidden
and the output gradient (torchao's, each weight's scale from the optimizer's block maxima where it keeps them),
the same float8 matmuls, and the gated activation's gradients rounded as its bf16 backward rounds them before
they are cast. It keeps x in float8 (the input cast the forward made, which the weight gradients' matmuls read
again), gate and up, and each tensor's scale.

It stands in for an MLP whose three projections are trained, bias-free Float8Linears with tensorwise scales, on
plain (not FSDP2-sharded) weights, outside autocast; any other MLP runs its modules (`gated_mlp_override`
returns None).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

from fusetune.kernels.float8_gated import gated_float8_backward, gated_float8_gradient_maxima
from fusetune.kernels.swiglu import gated_activation

if TYPE_CHECKING:
    from torchao.float8 import Float8LinearConfig

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@functools.cache
def gated_mlp_function() -> type:
    """The autograd function, built at first use (importing torchao takes seconds). `install` builds it and binds
    it to each MLP's override: a compiled layer that called this itself would trace into it (the compiler looks
    through the cache) and break its graph at the class statement, a place no measurement chose (the break the
    node takes is the one in `gated_mlp_override`)."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import (
        Float8TrainingTensor,
        GemmInputRole,
        hp_tensor_and_scale_to_float8,
    )
    from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

    def weight_scale(weight: torch.Tensor, maxima: torch.Tensor | None, config: Float8LinearConfig):
        """The weight's tensorwise scale: from its kept block maxima, or from a pass over it (torchao's)."""
        amax = maxima.max() if maxima is not None else tensor_to_amax(weight)
        return amax_to_scale(amax, config.cast_config_weight.target_dtype, config.round_scales_to_power_of_2)

    def weight8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, mm_config):
        """weight.t() in float8, as torchao's matmul takes a linear layer's weight."""
        return hp_tensor_and_scale_to_float8(weight.t(), scale, dtype, mm_config, GemmInputRole.WEIGHT)

    def dynamic8(tensor: torch.Tensor, dtype: torch.dtype, config, mm_config, role):
        return hp_tensor_to_float8_dynamic(
            tensor,
            dtype,
            mm_config,
            gemm_input_role=role,
            round_scales_to_power_of_2=config.round_scales_to_power_of_2,
        )

    def wrap(data: torch.Tensor, scale: torch.Tensor, mm_config, role) -> Float8TrainingTensor:
        return Float8TrainingTensor(data, scale, torch.bfloat16, mm_config, role)

    @torch._dynamo.allow_in_graph  # as torchao's own matmul: compiled layers trace through it
    class Float8GatedMLP(torch.autograd.Function):
        @staticmethod
        def forward(
            ctx, x, gate_w, up_w, down_w, gate_maxima, up_maxima, down_maxima, activation, config, mm_config
        ):
            weight_dtype = config.cast_config_weight.target_dtype
            scales = [
                weight_scale(w, m, config)
                for w, m in ((gate_w, gate_maxima), (up_w, up_maxima), (down_w, down_maxima))
            ]
            x8 = dynamic8(x.reshape(-1, x.shape[-1]), config.cast_config_input.target_dtype, config, mm_config,
                          GemmInputRole.INPUT)  # fmt: skip
            gate = torch.mm(x8, weight8(gate_w, scales[0], weight_dtype, mm_config))
            up = torch.mm(x8, weight8(up_w, scales[1], weight_dtype, mm_config))
            hidden8 = dynamic8(gated_activation(gate, up, activation), config.cast_config_input.target_dtype,
                               config, mm_config, GemmInputRole.INPUT)  # fmt: skip
            out = torch.mm(hidden8, weight8(down_w, scales[2], weight_dtype, mm_config))
            ctx.save_for_backward(
                x8._data, x8._scale, gate, up, hidden8._scale, gate_w, up_w, down_w, *scales
            )
            ctx.activation, ctx.config, ctx.mm_config = activation, config, mm_config
            return out.reshape(*x.shape[:-1], out.shape[-1])

        @staticmethod
        def backward(ctx, grad_out):
            x8_data, x_scale, gate, up, hidden_scale, gate_w, up_w, down_w, *weight_scales = ctx.saved_tensors
            config, mm_config = ctx.config, ctx.mm_config
            weight_dtype = config.cast_config_weight_for_grad_input.target_dtype
            grad_dtype = config.cast_config_grad_output.target_dtype
            grad8 = dynamic8(grad_out.reshape(-1, grad_out.shape[-1]), grad_dtype, config, mm_config,
                             GemmInputRole.GRAD_OUTPUT)  # fmt: skip
            grad_hidden = torch.mm(grad8, weight8(down_w, weight_scales[2], weight_dtype, mm_config).t())
            maxima = gated_float8_gradient_maxima(grad_hidden, gate, up, ctx.activation)
            round_scales = config.round_scales_to_power_of_2
            scales = torch.stack([
                hidden_scale.reshape(()),
                amax_to_scale(maxima[0], grad_dtype, round_scales),
                amax_to_scale(maxima[1], grad_dtype, round_scales),
            ])  # fmt: skip
            hidden_t, d_gate, d_gate_t, d_up, d_up_t = gated_float8_backward(
                grad_hidden,
                gate,
                up,
                ctx.activation,
                scales,
                config.cast_config_input.target_dtype,
                grad_dtype,
            )
            del grad_hidden
            # Down's weight gradient: grad_out^T @ hidden, hidden column-major as the float8 matmul takes it.
            hidden8 = wrap(hidden_t.t(), hidden_scale, mm_config, GemmInputRole.INPUT)
            grad_down_w = torch.mm(grad8.t(), hidden8)
            x8 = wrap(x8_data, x_scale, mm_config, GemmInputRole.INPUT)
            grad_x = None
            grads = []
            for d, d_t, weight, scale, index in ((d_gate, d_gate_t, gate_w, weight_scales[0], 1),
                                                 (d_up, d_up_t, up_w, weight_scales[1], 2)):  # fmt: skip
                d8 = wrap(d, scales[index], mm_config, GemmInputRole.GRAD_OUTPUT)
                part = torch.mm(d8, weight8(weight, scale, weight_dtype, mm_config).t())
                grad_x = part if grad_x is None else grad_x + part
                d8_t = wrap(d_t, scales[index], mm_config, GemmInputRole.GRAD_OUTPUT)
                grads.append(torch.mm(d8_t, x8))
            grad_x = grad_x.reshape(*grad_out.shape[:-1], grad_x.shape[-1])
            return grad_x, grads[0], grads[1], grad_down_w, None, None, None, None, None, None

    return Float8GatedMLP


def _float8_projections(mlp: nn.Module) -> tuple[nn.Module, ...] | None:
    """The MLP's (gate, up, down) when they are bias-free, hook-free float8 layers of one config that casts each
    tensor with one scale (tensorwise), the same for both matmuls that read it; None otherwise. What can change
    between calls (whether the weights are trained, FSDP2's sharding) `gated_mlp_override` checks at each."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear

    projections = tuple(getattr(mlp, name, None) for name in PROJECTIONS)
    for projection in projections:
        if not isinstance(projection, Float8Linear) or projection.bias is not None:
            return None
        if projection._forward_hooks or projection._forward_pre_hooks:
            return None
        config = projection.config
        if config != projections[0].config or projection.linear_mm_config != projections[0].linear_mm_config:
            return None
        pairs = (  # each cast and the one of the same tensor for the other matmul: the node casts each once
            (config.cast_config_input, config.cast_config_input_for_grad_weight),
            (config.cast_config_weight, config.cast_config_weight_for_grad_input),
            (config.cast_config_grad_output, config.cast_config_grad_output_for_grad_weight),
        )
        for cast, other in pairs:
            if cast.scaling_granularity is not ScalingGranularity.TENSORWISE or other != cast:
                return None
    return projections


def _plain_trained(weight: torch.Tensor) -> bool:
    """A weight that takes a gradient and is a whole plain tensor (not a LoRA base, not an FSDP2 shard)."""
    return weight.requires_grad and not hasattr(weight, "to_local")


def gated_mlp_override(
    node: type,
    projections: tuple[nn.Module, nn.Module, nn.Module],
    hidden_states: torch.Tensor,
    activation: str,
) -> torch.Tensor | None:
    """The MLP's output through `node` (`gated_mlp_function()`), or None when the MLP must run its modules (the
    module docstring); `install` sets it, bound to the node and the MLP's projections, as
    `mlp.gated_mlp_override`, which fusetune's gated-MLP forward calls."""
    gate, up, down = projections
    if not all(_plain_trained(p.weight) for p in projections):
        return None
    if torch.is_autocast_enabled() or hidden_states.dtype != torch.bfloat16:
        return None
    # A compiled layer compiles the node as a graph of its own. Traced with the attention block as one graph,
    # Inductor fused the float8 casts of the attention's input worse (two passes for its largest magnitude, and
    # its transposed copy for the weight gradient in a kernel of its own: 5-6 ms more kernel time in a 200 ms
    # step), and at the Llama-3.2-1B shape, 8 x 2,048 tokens, one H200 call measured 80,776 and 81,236 tokens/s
    # against 82,113 with this break (h200-step.md, e2e-fp8-llama-one, -split, -one2); other calls put the one
    # graph 0.4-2% behind at Qwen2.5-1.5B, Gemma-2-2B and Llama-3.1-8B (e2e-fp8-one-graph, e2e-fp8-8b-one-graph
    # against e2e-fp8-mlp-node-no-clone, e2e-fp8-8b-mlp-node). The break's own cost, a return to Python and a
    # guard check per layer, stays hidden while the host runs ahead of the GPU.
    torch._dynamo.graph_break()
    return node.apply(
        hidden_states,
        gate.weight,
        up.weight,
        down.weight,
        getattr(gate, "weight_maxima", None),
        getattr(up, "weight_maxima", None),
        getattr(down, "weight_maxima", None),
        activation,
        gate.config,
        gate.linear_mm_config,
    )


def install(model: nn.Module) -> int:
    """Let each MLP of `model` with float8 gate, up and down projections run as one node (the module docstring);
    returns how many. fusetune's gated-MLP forward calls `gated_mlp_override` where an MLP has it."""
    count = 0
    for module in model.modules():
        projections = _float8_projections(module)
        if projections is not None:
            module.gated_mlp_override = functools.partial(
                gated_mlp_override, gated_mlp_function(), projections
            )
            count += 1
    return count
