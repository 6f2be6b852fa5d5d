"""The fp8 precision mode's change to the model: the decoder's linear layers compute in float8.

torchao's float8 training (`convert_to_float8_training`) swaps each chosen `nn.Linear` for its `Float8Linear`,
which keeps the same bf16 weight and bias parameters (so the optimizer, DDP, FSDP2, LoRA's merge and the
checkpoints see the parameters they always did, under the same state-dict keys) and casts the input, the
weight and, in the backward, the output gradient to float8 with scales computed from each tensor on every
call (dynamic scaling), then multiplies on the float8 tensor cores.

Which layers: every linear layer of the decoder except
- the output layer (`lm_head`): it stays bf16 inside the fused linear cross-entropy, which never builds the
  logits; a float8 head would need its own kernel, and its gradient is the loss's most sensitive one;
- LoRA's adapters (`lora_A`, `lora_B`): they stay bf16 and are trained as in bf16-sr; the frozen base layer
  they wrap computes in float8;
- a mixture of experts' router: its top-k choice is a comparison of logits that float8 rounding could flip;
- layers whose input or output size is not a multiple of 16, which the float8 matmul (`torch._scaled_mm`)
  refuses.

The fused MLP block (fusetune/models/fused.py) runs the whole MLP as one autograd node only over plain
`nn.Linear` projections. With `Float8Linear`s in place, an MLP whose three projections are trained and
tensorwise runs as the float8 node of float8_mlp.py instead (`convert_linears` installs it): its three matmuls
in float8, the gated activation's backward writing its gradients straight into float8. At the Gemma-2-2B shape,
8 x 2,048 tokens, on an H200 (h200-step.md, e2e-fp8-gemma-mlp-node): 32,345 tokens/s at 45.5 GB against
Liger-Kernel's 26,095 at 54.0 (1.240x, 0.843x); through the projection modules it had run at 31,241 and 46.0 GB
(e2e-fp8-gemma-backward-peak). Any other MLP (a LoRA base, FSDP2's shards, rowwise scales) calls its projection
modules, with the fused gated activation between them.

Where torchao falls short, for a later fused kernel once the GPU profile says it matters: the cast of each
matmul's input to float8 (and, rowwise, its scales) is a pass of its own over the activation, after the RMSNorm
that made it (q, k, v, gate and up) and after the gated activation (down); a kernel that wrote float8 and its
scales from the norm's or the activation's epilogue would save that pass. And torchao's float8 matmul computes
the weight gradient whatever the weight: for a frozen weight (a LoRA base layer) `frozen_aware_float8_linear`
runs the input gradient alone, with torchao's casts, and keeps no input for the backward.

A trained layer's weight scale (tensorwise: 448 over the weight's largest magnitude) comes from block maxima
that FusedAdamW's step writes from the values it stores (`weight_scales_from_optimizer`), instead of torchao's
pass over the whole weight at every cast: the same scale, so the same bits, without reading 2 bytes per
parameter twice a micro-batch. Llama-3.1-8B shape, 1 x 4,096, one H200 in one call (h200-step.md,
e2e-fp8-8b-weight-maxima): 13,837 tokens/s against 13,562 with torchao's passes, bf16-sr 10,939. The 8-bit
optimizer (fp8-8bit) keeps no maxima yet: its whole weights keep torchao's passes. Under FSDP2, whose all-gather
sends the weights in float8, the scales are set once a step, agreed over the ranks by one all-reduce, from each
rank's shard maxima or, without maxima, from its shard read once (`ShardedWeightScales`).

Eager float8 runs its casts as separate small kernels; `compile_layers` compiles each decoder layer (in place,
so parameter names do not change) so that Inductor fuses them: compiling a whole 8B model with float8 did not
finish within 140 s on an H100 (shared/PLATFORM.md), one layer at a time compiles once and reuses it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from fusetune.models.wrappers import unwrap_model
from fusetune.worker.train import float8_mlp
from fusetune.worker.train.activations import decoder_layers
from fusetune.worker.train.outcome import ErrorCode, TrainingFailure

if TYPE_CHECKING:
    from torchao.float8 import Float8LinearConfig

    from fusetune.worker.train.precision import PrecisionPolicy
    from fusetune.worker.train.reporter import Reporter

# The scaling recipe of the fp8 mode: "tensorwise" (one scale per tensor, the output gradient in e5m2; the only
# recipe whose weights FSDP2 can all-gather in float8), "rowwise" (a scale per row of each operand, e4m3 in both
# directions) or "rowwise_with_gw_hp" (rowwise, with the weight gradient computed in bf16: no float8 cast of the
# activations along the token axis, a third of the matmuls not sped up). Tensorwise because it is the one that
# is faster than bf16: Llama-3.1-8B shape, 1 x 4096, one H200 in one call (benchmarks/results/h200-step.md,
# section e2e-fp8-recipes): bf16-sr 10,563 tokens/s, tensorwise 13,028, rowwise 10,382, rowwise_with_gw_hp
# 11,652. Rowwise's casts along both axes of every operand (amax over rows, then over columns, each its own
# pass) cost more than its float8 matmuls save. Its quality: benchmarks/quality/float8.py.
RECIPE = "tensorwise"
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
# torch._scaled_mm needs both matmul dimensions of each operand to be multiples of 16.
DIMENSION_MULTIPLE = 16
# The weight gradient's float8 matmul (grad_output.T @ input) takes a micro-batch's token count as its inner
# dimension, so the trainer pads a batch's rows to a length that makes it a multiple of 16 (a packed job's rows
# have any length; a compiled layer fails on an odd one).
TOKEN_MULTIPLE = DIMENSION_MULTIPLE
LORA_ADAPTER_NAMES = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
ROUTER_NAMES = ("gate", "router")


@dataclass(frozen=True)
class Float8Conversion:
    """What `convert_linears` did: the recipe, the layers converted and those left in bf16 with the reason."""

    recipe: str
    converted: list[str] = field(default_factory=list)
    left: dict[str, str] = field(default_factory=dict)
    fsdp_float8_all_gather: bool = False
    compiled_layers: int = 0
    fused_mlps: int = 0

    def event(self) -> tuple[str, dict]:
        """The `float8` event of a run: (message, data)."""
        reasons: dict[str, int] = {}
        for reason in self.left.values():
            reasons[reason] = reasons.get(reason, 0) + 1
        left = "; ".join(f"{count} {reason}" for reason, count in reasons.items())
        message = f"Float8 linear layers ({self.recipe} scaling): {len(self.converted)} converted"
        message += f", left in bf16: {left}" if left else ""
        data = {
            "event": "float8",
            "recipe": self.recipe,
            "converted": len(self.converted),
            "left": self.left,
            "fsdp_float8_all_gather": self.fsdp_float8_all_gather,
            "compiled_layers": self.compiled_layers,
            "fused_mlps": self.fused_mlps,
        }
        return message, data


@functools.cache
def frozen_aware_float8_linear() -> type:
    """torchao's Float8Linear, whose weight, when it takes no gradient, costs no weight-gradient matmul: the
    forward as torchao's, the backward only grad_input = cast(grad_output) @ cast(weight).T, with the casts of
    torchao's grad_input matmul. Built at first use: importing torchao takes seconds, which every other
    precision's trainer would pay."""
    from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import amax_to_scale

    def cast(tensor, cast_config, config, mm_config, role, axis: int):
        # As is when it arrived in float8 (FSDP2's float8 all-gather).
        if tensor_already_casted_to_fp8(tensor):
            return tensor
        return hp_tensor_to_float8_dynamic(
            tensor,
            cast_config.target_dtype,
            mm_config,
            gemm_input_role=role,
            scaling_granularity=cast_config.scaling_granularity,
            axiswise_dim=get_maybe_axiswise_dim(axis, cast_config.scaling_granularity),
            round_scales_to_power_of_2=config.round_scales_to_power_of_2,
        )

    def matmul(input8, weight8):
        """input8 @ weight8 over every leading dimension of input8."""
        output = torch.mm(input8.reshape(-1, input8.shape[-1]), weight8)
        return output.reshape(*input8.shape[:-1], output.shape[-1])

    def input_gradient(grad_output, weight8, config, mm_config):
        """grad_output @ weight8.t(), the output gradient cast as torchao's grad_input matmul casts it."""
        flat = grad_output.reshape(-1, grad_output.shape[-1])
        grad8 = cast(flat, config.cast_config_grad_output, config, mm_config, GemmInputRole.GRAD_OUTPUT, -1)
        grad_input = torch.mm(grad8, weight8.t())
        return grad_input.reshape(*grad_output.shape[:-1], grad_input.shape[-1])

    class FrozenWeightMatmul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, input_hp, weight_hp_t, mm_config, config):
            ctx.save_for_backward(weight_hp_t)
            ctx.mm_config, ctx.config = mm_config, config
            input8 = cast(input_hp, config.cast_config_input, config, mm_config, GemmInputRole.INPUT, -1)
            weight8 = cast(weight_hp_t, config.cast_config_weight, config, mm_config, GemmInputRole.WEIGHT, 0)
            return matmul(input8, weight8)

        @staticmethod
        def backward(ctx, grad_output):
            (weight_hp_t,) = ctx.saved_tensors
            config, mm_config = ctx.config, ctx.mm_config
            weight8 = cast(
                weight_hp_t,
                config.cast_config_weight_for_grad_input,
                config,
                mm_config,
                GemmInputRole.WEIGHT,
                -1,
            )
            return input_gradient(grad_output, weight8, config, mm_config), None, None, None

    @torch._dynamo.allow_in_graph  # as torchao's own matmul: compiled layers trace through it, not into it
    class KeptMaximaWeightMatmul(torch.autograd.Function):
        """torchao's tensorwise float8 matmul with the weight's scale from its kept block maxima (the optimizer's,
        FusedAdamW.keep_block_maxima) instead of a pass over the weight: the same scale, so the same bits."""

        @staticmethod
        def forward(ctx, input_hp, weight_hp_t, weight_maxima, mm_config, config):
            scale = amax_to_scale(
                weight_maxima.max(), config.cast_config_weight.target_dtype, config.round_scales_to_power_of_2
            )
            ctx.save_for_backward(input_hp, weight_hp_t, scale)
            ctx.mm_config, ctx.config = mm_config, config
            input8 = cast(input_hp, config.cast_config_input, config, mm_config, GemmInputRole.INPUT, -1)
            weight8 = hp_tensor_and_scale_to_float8(
                weight_hp_t, scale, config.cast_config_weight.target_dtype, mm_config, GemmInputRole.WEIGHT
            )
            return matmul(input8, weight8)

        @staticmethod
        def backward(ctx, grad_output):
            input_hp, weight_hp_t, scale = ctx.saved_tensors
            config, mm_config = ctx.config, ctx.mm_config
            weight8 = hp_tensor_and_scale_to_float8(
                weight_hp_t,
                scale,
                config.cast_config_weight_for_grad_input.target_dtype,
                mm_config,
                GemmInputRole.WEIGHT,
            )
            grad_input = input_gradient(grad_output, weight8, config, mm_config)
            flat = grad_output.reshape(-1, grad_output.shape[-1])
            input_flat = input_hp.reshape(-1, input_hp.shape[-1])
            grad8_for_weight = cast(
                flat,
                config.cast_config_grad_output_for_grad_weight,
                config,
                mm_config,
                GemmInputRole.GRAD_OUTPUT,
                0,
            )
            input8_for_weight = cast(
                input_flat,
                config.cast_config_input_for_grad_weight,
                config,
                mm_config,
                GemmInputRole.INPUT,
                0,
            )
            grad_weight = torch.mm(grad8_for_weight.t(), input8_for_weight)
            return grad_input, grad_weight.t(), None, None, None

    class FrozenAwareFloat8Linear(Float8Linear):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            # The weight's block maxima, a buffer the optimizer keeps (weight_scales_from_optimizer), or none.
            maxima = getattr(self, "weight_maxima", None)
            if torch.is_autocast_enabled():
                return super().forward(input)
            if not self.weight.requires_grad:
                output = FrozenWeightMatmul.apply(input, self.weight.t(), self.linear_mm_config, self.config)
            elif maxima is not None:
                output = KeptMaximaWeightMatmul.apply(
                    input, self.weight.t(), maxima, self.linear_mm_config, self.config
                )
            else:
                return super().forward(input)
            return output + self.bias.to(output.dtype) if self.bias is not None else output

    return FrozenAwareFloat8Linear


def weight_scales_from_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Have the trained float8 layers' weight scales (tensorwise) follow `optimizer`'s steps instead of a pass
    over the whole weight each time it is cast (forward and backward of every micro-batch): at the Llama-3.1-8B
    shape, 1 x 4,096 tokens, those passes took 5.3 ms of a 301 ms step on an H200 (h200-step.md,
    e2e-fp8-8b-kernels). Returns how many layers read block maxima that the optimizer keeps.

    Where it can (FusedAdamW.keep_block_maxima), the optimizer keeps the block maxima of the weights it stores,
    at the cost of a reduction over what its step already holds: a whole weight reads them in its forward (the
    `weight_maxima` buffer); a weight FSDP2 shards and all-gathers in float8 keeps its shard's, from which
    `ShardedWeightScales` sets its scale before each all-gather, agreed over the ranks. An optimizer without
    maxima (the 8-bit one) leaves whole weights to torchao's passes, and `ShardedWeightScales` reads each shard
    once a step instead of torchao at every all-gather. A frozen weight that FSDP2 shards (a LoRA base) gets its
    scale once, here."""
    from torchao.float8.config import ScalingGranularity

    tensorwise = [
        module
        for module in model.modules()
        if isinstance(module, frozen_aware_float8_linear())
        and module.config.cast_config_weight.scaling_granularity is ScalingGranularity.TENSORWISE
    ]
    frozen = [m for m in tensorwise if not m.weight.requires_grad and _all_gathered_in_float8(m.weight)]
    if frozen:  # a sharded LoRA base: its scales once, as its weights never change
        ShardedWeightScales(frozen, [None] * len(frozen)).refresh()
    layers = [layer for layer in tensorwise if layer.weight.requires_grad]
    whole = [layer for layer in layers if not hasattr(layer.weight, "to_local")]
    sharded = [layer for layer in layers if _all_gathered_in_float8(layer.weight)]
    if not hasattr(optimizer, "keep_block_maxima"):
        if sharded:
            ShardedWeightScales(sharded, [None] * len(sharded)).follow(optimizer)
        return 0
    maxima = optimizer.keep_block_maxima([layer.weight for layer in whole + sharded])
    for layer in whole:
        layer.register_buffer("weight_maxima", maxima[layer.weight], persistent=False)
    if sharded:
        ShardedWeightScales(sharded, [maxima[layer.weight] for layer in sharded]).follow(optimizer)
    return len(whole) + len(sharded)


def _all_gathered_in_float8(weight: torch.Tensor) -> bool:
    """An FSDP2 shard that FSDP2 all-gathers in float8 (torchao's weight tensor under the DTensor)."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return isinstance(getattr(weight, "_local_tensor", None), WeightWithDynamicFloat8CastTensor)


class ShardedWeightScales:
    """The tensorwise scales of weights that FSDP2 shards and all-gathers in float8, set once per optimizer step:
    each rank's largest magnitude per weight, a max over the block maxima the optimizer's step writes over its
    shard (or, for a weight without, over the shard itself), then one all-reduce of those few values (max)
    gives every weight's, and torchao's weight tensor casts its shard with the scale set here before each
    all-gather (its `_precomputed_scale`). Left to itself torchao reads the whole shard and all-reduces at
    every all-gather, one weight at a time (each micro-batch's forward, and its backward where FSDP2 gathers
    again). The same largest magnitude and the same formula (torchao's `amax_to_scale`), so the same scale and
    the same bits."""

    def __init__(self, layers: list[nn.Module], maxima: list[torch.Tensor | None]) -> None:
        self.layers, self.maxima = layers, maxima
        config = layers[0].config
        self.float8_dtype = config.cast_config_weight.target_dtype
        self.round_scales_to_power_of_2 = config.round_scales_to_power_of_2
        self.mesh = layers[0].weight.device_mesh

    def follow(self, optimizer: torch.optim.Optimizer) -> None:
        """Set the scales now, from the weights as they are, and after each step of `optimizer`: of every
        weight, or of those a step of some parameters changed (the optimizer step inside the backward steps
        one at a time)."""
        self.refresh()
        optimizer.register_step_post_hook(lambda _, args, kwargs: self.refresh(kwargs.get("params")))

    @torch.no_grad()
    def refresh(self, stepped: Sequence[torch.Tensor] | None = None) -> None:
        import torch.distributed as dist
        from torchao.float8.float8_utils import amax_to_scale

        chosen = [
            (layer, maxima)
            for layer, maxima in zip(self.layers, self.maxima, strict=True)
            if stepped is None or any(layer.weight is param for param in stepped)
        ]
        if not chosen:
            return
        kept = [layer.weight._local_tensor._tensor if m is None else m for layer, m in chosen]
        # One multi-tensor kernel for all the largest magnitudes (not two launches a weight). A rank may hold no
        # elements of a small weight (more ranks than rows), where the norm has no value: zero is no magnitude.
        held = [index for index, k in enumerate(kept) if k.numel()]
        amax = torch.zeros(len(kept), dtype=torch.float32, device=kept[0].device)
        if held:
            norms = torch._foreach_norm([kept[index] for index in held], ord=math.inf)
            amax[held] = torch.stack(norms).float()
        for dim in range(self.mesh.ndim):  # max is the same whichever order the mesh's groups reduce in
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.mesh.get_group(dim))
        scales = amax_to_scale(amax, self.float8_dtype, self.round_scales_to_power_of_2)
        for (layer, _), scale in zip(chosen, scales, strict=True):
            layer.weight._local_tensor._precomputed_scale = scale


def float8_config(recipe: str = RECIPE, *, emulate: bool = False, fsdp: bool = False) -> Float8LinearConfig:
    """torchao's config of `recipe`. `emulate`: the casts as on a GPU, the matmul in the input's dtype on the
    dequantized operands (CPUs and GPUs without float8 tensor cores; tests). `fsdp`: all-gather FSDP2's
    weight shards in float8 where the recipe allows it (tensorwise: one scale, agreed over the shards)."""
    from torchao.float8 import Float8LinearConfig

    if recipe not in RECIPES:
        raise ValueError(f"float8 recipe {recipe!r} is not one of {', '.join(RECIPES)}")
    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(
        config, emulate=emulate, enable_fsdp_float8_all_gather=fsdp and recipe == "tensorwise"
    )


def why_not_converted(model: nn.Module, module: nn.Module, fqn: str) -> str | None:
    """Why the linear layer `module` at `fqn` stays in bf16, or None to convert it."""
    if module is _output_layer(model):
        return "the output layer (bf16 in the fused linear cross-entropy)"
    parts = fqn.split(".")
    if any(part in LORA_ADAPTER_NAMES for part in parts):
        return "LoRA adapters (trained in bf16)"
    if parts[-1] in ROUTER_NAMES and hasattr(model.get_submodule(".".join(parts[:-1])), "experts"):
        return "a mixture of experts' router"
    if module.in_features % DIMENSION_MULTIPLE or module.out_features % DIMENSION_MULTIPLE:
        return f"sizes not multiples of {DIMENSION_MULTIPLE}"
    return None


def _output_layer(model: nn.Module) -> nn.Module | None:
    base = unwrap_model(model)
    return base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None


def convert_linears(
    model: nn.Module,
    config: Float8LinearConfig,
    recipe: str = RECIPE,
    *,
    compile_layers: bool = False,
    compile_mode: str | None = None,
) -> Float8Conversion:
    """Swap the decoder's linear layers of `model` (in place; PEFT-wrapped too) for torchao's Float8Linear
    with `config` (`recipe` names it in the report); compile each decoder layer in place if `compile_layers`,
    in torch.compile's `compile_mode` (None: its default; "reduce-overhead" replays each layer as CUDA graphs,
    for the benchmark that measures whether the launch gaps float8's extra kernels leave are worth it)."""
    from torchao.float8 import convert_to_float8_training

    converted: list[str] = []
    left: dict[str, str] = {}

    def module_filter(module: nn.Module, fqn: str) -> bool:
        if type(module) is not nn.Linear:
            return False
        reason = why_not_converted(model, module, fqn)
        if reason is None:
            converted.append(fqn)
        else:
            left[fqn] = reason
        return reason is None

    convert_to_float8_training(model, module_filter_fn=module_filter, config=config)
    frozen_aware = frozen_aware_float8_linear()
    for name in converted:
        model.get_submodule(name).__class__ = frozen_aware
    fused_mlps = float8_mlp.install(model)
    layers = decoder_layers(model) if compile_layers else []
    for layer in layers:
        if layer._forward_pre_hooks or layer._forward_hooks:
            # Activation offload's hooks enter its saved-tensor hooks around the layer's forward. Compiling the
            # whole call would trace them into the graph, so only the forward compiles: the hooks stay eager
            # around it and pack what the compiled graph saves. (Left eager, such a layer ran its float8 casts
            # as separate kernels: 8 of 32 layers offloaded made an 8B fp8 step 1.61x slower, h100-step.md's
            # memory-plans-time-model, where 12 of bf16's, at twice the rows, had cost 1.35x.)
            layer.forward = torch.compile(layer.forward, mode=compile_mode)
        else:
            layer.compile(mode=compile_mode)
    return Float8Conversion(
        recipe,
        converted,
        left,
        config.enable_fsdp_float8_all_gather,
        compiled_layers=len(layers),
        fused_mlps=fused_mlps,
    )


def apply(model: nn.Module, precision: PrecisionPolicy, reporter: Reporter) -> Float8Conversion | None:
    """The trainer's call: convert `model`'s decoder linears when the precision mode computes them in float8
    (None otherwise), before the model is wrapped for DDP or sharded by FSDP2, and report what was done. Off a
    GPU the casts are emulated (only tests run the mode there: the worker refuses it on a CPU)."""
    if not precision.float8_linears:
        return None
    on_gpu = precision.device.type == "cuda"
    config = float8_config(RECIPE, emulate=not on_gpu, fsdp=precision.fsdp)
    conversion = convert_linears(model, config, RECIPE, compile_layers=on_gpu)
    if not conversion.converted:
        raise TrainingFailure(
            ErrorCode.TRAINER_ERROR,
            f"precision {precision.name!r} found no decoder linear layer of this model it can run in float8 "
            f"({'; '.join(sorted(set(conversion.left.values()))) or 'no linear layers'}); use 'bf16-sr'",
        )
    message, data = conversion.event()
    reporter.event(message, data=data)
    return conversion
