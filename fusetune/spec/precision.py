"""Precision modes and optimizers: what a job's `precision` means, as data.

A mode says which dtype the weights are kept and updated in, which dtype the matmuls run in, which optimizer
updates them and in which dtype that optimizer keeps its state. The estimate reads bytes per parameter from
here; the trainer resolves a mode for its device (fusetune/worker/train/precision.py) and builds the optimizer
named here (fusetune/worker/train/optim.py, whose table has one builder per name of `OPTIMIZERS`).

Adding a mode is one entry in `PRECISIONS`; adding an optimizer is one entry in `OPTIMIZERS` plus its builder.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

AUTO = "auto"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "uint8": 1}


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    # Tensors of state per trained parameter, each the size of the parameter (AdamW: exp_avg, exp_avg_sq).
    states_per_parameter: int
    description: str
    # The dtype its state is kept in; None: the weights' (torch's AdamW and FusedAdamW keep it so).
    state_dtype: str | None = None
    # Bytes of scales per element of state, for blockwise-quantized state (one fp32 scale per block).
    scale_bytes_per_state: float = 0.0
    # Whether it updates FSDP2's sharded (DTensor) parameters.
    supports_fsdp: bool = True
    # Whether it can keep its state in host memory, staging each parameter's on the GPU for its update (the
    # memory plan's optimizer_state_on_host).
    supports_host_state: bool = False

    def state_bytes_per_parameter(self, weight_dtype: str) -> float:
        dtype_bytes = DTYPE_BYTES[self.state_dtype or weight_dtype]
        return self.states_per_parameter * (dtype_bytes + self.scale_bytes_per_state)


OPTIMIZERS: dict[str, OptimizerSpec] = {
    spec.name: spec
    for spec in (
        OptimizerSpec("adamw", 2, "torch.optim.AdamW (fused on GPUs)"),
        OptimizerSpec(
            "adamw-stochastic-rounding", 2,
            "fusetune.kernels.FusedAdamW: one fused update, the bf16 results rounded stochastically",
            supports_host_state=True,
        ),
        OptimizerSpec(
            "adamw-8bit", 2,
            "fusetune.kernels.FusedAdamW8bit: FusedAdamW's update with both moments in 8-bit codes and one fp32 "
            "scale per 256-element block, requantized in the same launch",
            state_dtype="uint8", scale_bytes_per_state=4 / 256, supports_host_state=True,
        ),
    )
}  # fmt: skip


@dataclass(frozen=True)
class PrecisionMode:
    name: str
    weight_dtype: str  # parameters as loaded, trained and saved
    compute_dtype: str  # matmuls: under autocast (one process, DDP) or FSDP's gathered parameters
    optimizer: str  # key of OPTIMIZERS
    needs_gpu: bool
    description: str
    # The tensor-core peak MFU divides by. Every mode reports against the dense bf16 peak, so that MFU compares
    # across modes (a faster number format shows as a higher MFU, not as a different denominator).
    mfu_peak_dtype: str = "bfloat16"
    # The decoder's linear layers compute in float8 with dynamic scales (fusetune/worker/train/float8.py); the
    # weights, gradients and optimizer state stay as `weight_dtype` and `optimizer` say.
    float8_linears: bool = False
    # The lowest CUDA compute capability that runs the mode: float8 tensor cores start at 8.9 (Ada, Hopper).
    min_compute_capability: tuple[int, int] | None = None
    # The kinds of device ("gpu", "cpu") on which a job's precision "auto" may become this mode: the planner
    # chooses among them, and the first of the table for a kind is that kind's default (`auto_precisions`).
    auto_on: tuple[str, ...] = ()

    @property
    def mixed(self) -> bool:
        """Compute in a narrower dtype than the weights (autocast, or FSDP's bf16 gathers)."""
        return self.compute_dtype != self.weight_dtype

    @property
    def weight_bytes(self) -> int:
        return DTYPE_BYTES[self.weight_dtype]

    @property
    def compute_copy_bytes(self) -> int:
        """Bytes of the compute-dtype copy a mixed mode makes of each weight (kept for the backward)."""
        return DTYPE_BYTES[self.compute_dtype] if self.mixed else 0

    @property
    def optimizer_state_dtype(self) -> str:
        return OPTIMIZERS[self.optimizer].state_dtype or self.weight_dtype

    @property
    def optimizer_state_bytes(self) -> float:
        """Optimizer state per trained parameter."""
        return OPTIMIZERS[self.optimizer].state_bytes_per_parameter(self.weight_dtype)


def _with_float8_linears(mode: PrecisionMode, name: str, description: str) -> PrecisionMode:
    """`mode` with the decoder's linear layers computing in float8: its weights, gradients and optimizer as they
    are (`same_compute` pairs the float8 modes by this), on the GPUs with float8 tensor cores, never "auto"."""
    return replace(
        mode,
        name=name,
        description=description,
        float8_linears=True,
        min_compute_capability=(8, 9),
        auto_on=(),
    )


_BF16_SR = PrecisionMode(
    "bf16-sr", "bfloat16", "bfloat16", "adamw-stochastic-rounding", needs_gpu=True,
    description="bf16 weights, gradients and AdamW state, the update stochastically rounded "
    "(fusetune.kernels.FusedAdamW): the quality of fp32 master weights at half their memory "
    "(tests/kernels/test_adamw_quality.py)",
    # "auto"'s default on GPUs: it fine-tuned to the eval loss of fp32 master weights where plain bf16
    # did not (tests/kernels/test_adamw_quality.py).
    auto_on=("gpu",),
)  # fmt: skip
# Also "auto" on a GPU, when only its smaller state fits (slower by the 8-bit step's overhead).
_BF16_SR_8BIT = replace(
    _BF16_SR, name="bf16-sr-8bit", optimizer="adamw-8bit",
    description="bf16-sr with the AdamW moments in 8 bits (fusetune.kernels.FusedAdamW8bit): about 2 "
    "bytes of optimizer state per parameter instead of 4, within 0.2% of fp32 master weights' eval "
    "loss in tests/kernels/test_adamw_quality.py; under FSDP each rank quantizes its own shard",
)  # fmt: skip

PRECISIONS: dict[str, PrecisionMode] = {
    mode.name: mode
    for mode in (
        PrecisionMode(
            "fp32", "float32", "float32", "adamw", needs_gpu=False,
            description="fp32 weights, compute and AdamW state",
            auto_on=("cpu",),
        ),
        PrecisionMode(
            "bf16-mixed", "float32", "bfloat16", "adamw", needs_gpu=True,
            description="fp32 weights and AdamW state, bf16 compute (autocast under DDP, bf16-gathered "
            "parameters and fp32 gradient reduction under FSDP)",
        ),
        PrecisionMode(
            "bf16", "bfloat16", "bfloat16", "adamw", needs_gpu=True,
            description="bf16 weights and AdamW state, rounded to nearest: updates under about 2^-9 of a weight "
            "are lost, so fine-tuning at small learning rates barely moves many weights",
        ),
        _BF16_SR,
        _BF16_SR_8BIT,
        _with_float8_linears(
            _BF16_SR, "fp8",
            "bf16-sr's weights, gradients and AdamW state, with the decoder's linear layers "
            "computing in float8 (e4m3, dynamic scales; torchao's float8 training) and the output layer in "
            "bf16: float8 tensor cores run twice the bf16 rate; needs compute capability 8.9 or newer "
            "(H100, H200, L40S)",
        ),
        _with_float8_linears(
            _BF16_SR_8BIT, "fp8-8bit",
            "fp8's float8 linear layers with bf16-sr-8bit's optimizer (the AdamW moments in 8 "
            "bits): the fastest matmuls and the smallest optimizer state together",
        ),
    )
}  # fmt: skip


def auto_precisions(on_gpu: bool = True) -> tuple[str, ...]:
    """What a job's precision "auto" may become on a GPU (or a CPU), the default first: the table's modes
    marked `auto_on` that kind of device, in the table's order."""
    kind = "gpu" if on_gpu else "cpu"
    return tuple(mode.name for mode in PRECISIONS.values() if kind in mode.auto_on)


GPU_DEFAULT = auto_precisions(on_gpu=True)[0]
CPU_DEFAULT = auto_precisions(on_gpu=False)[0]
PRECISION_NAMES: tuple[str, ...] = (AUTO, *PRECISIONS)


def mode_for(name: str, on_gpu: bool = True) -> PrecisionMode:
    """The mode a job's `precision` names ("auto" resolved for a GPU unless `on_gpu` is False)."""
    if name == AUTO:
        name = GPU_DEFAULT if on_gpu else CPU_DEFAULT
    return PRECISIONS[name]


def same_compute(name: str) -> list[PrecisionMode]:
    """The modes that compute as `name` does (weights, compute dtype, float8 linears) with another optimizer:
    fp8 and fp8-8bit, bf16-sr and bf16-sr-8bit, which a plan may trade for one another."""
    mode = PRECISIONS[name]

    def compute(m: PrecisionMode) -> tuple:
        return (m.weight_dtype, m.compute_dtype, m.float8_linears, m.min_compute_capability, m.needs_gpu)

    return [other for other in PRECISIONS.values() if other.name != name and compute(other) == compute(mode)]
