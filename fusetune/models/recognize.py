"""Recognising a decoder family that has no row in the table, by the structure of a built model.

The walk finds the parts fusetune has kernels for, proposes for each the fused replacement a table row would
name, and proves it with a numerical probe (`probe.py`) before it counts. Parts, and how each is found:

- RMS norms: modules whose only parameter is a 1-D `weight`, with no children and a float epsilon
  attribute. The casting mode and the weight offset are chosen by comparing the module's forward with
  `rms_norm_reference` in each mode on bfloat16 and float32 rows (exact for the right one); the kernel is then
  probed in that mode. The probe's rows span magnitudes down to sqrt(eps) and carry a mean, so a norm with
  another epsilon or one that subtracts the mean (a LayerNorm) fails it.
- Gated MLPs: modules with `down_proj` and either `gate_proj` + `up_proj` or one `gate_up_proj` ([gate, up]
  halves), whose config names an activation with a kernel (silu: SwiGLU; gelu_pytorch_tanh / gelu_new /
  gelu: GeGLU). The probe runs the module's own forward against the fused one on its own weights.
- MoE experts: modules with a 3-D `gate_up_proj` and transformers' `_apply_gate`; probed on a random
  [gate; up] projection. The experts' MLP then takes the gated activation kernel.
- The decoder layer: the class transformers names in `_no_split_modules`. The order in which one call of it
  runs its norms, attention and MLP gives the layout (norm, attention, norm, MLP: pre-norm; four norms:
  sandwich; attention, norm, MLP, norm: post-norm); a float attribute of the layer (Granite's
  residual_multiplier) is tried as the branch scale when the plain layout does not match. The fused layer is
  probed on the inputs the model itself hands its first layer.
- The rotary function: the module-level function whose name mentions rotary / rope and that the attention's
  forward references; its arguments are recorded from a real call and the kernel is probed on them.
- The causal-LM head and loss: `lm_head` (an nn.Linear) on the base model's last hidden states, with the
  config's final logit soft-capping and constant logit scaling where it has them, and the MoE router
  auxiliary loss where the model adds one. The probe replaces the base model by one that returns random
  hidden states, so only the head and the loss run.

What the walk finds is a `FamilySpec`, the same shape as a row of `families.py`, patched by the same code as
a row. Anything not found, or failing its probe, stays as it is and is listed in `Recognition.left` with the
reason. Probes run on the device the model trains on (the kernels need a GPU or the Triton interpreter);
parts of a model held elsewhere are copied there for their probe.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import math
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch import nn

import fusetune.models.fused as fused
from fusetune.kernels._interpreter import interpreted
from fusetune.kernels.rms_norm import rms_norm_reference
from fusetune.models.families import DEFAULT_DECODER_NORMS, FamilySpec
from fusetune.models.options import PatchOptions
from fusetune.models.probe import (
    MakeCall,
    ProbeCall,
    ProbeResult,
    compare,
    first_tensors,
    run_probe,
    tolerance_for,
)
from fusetune.models.wrappers import unwrap_model

# Kinds of part, as the report names them.
NORM, MLP, EXPERTS, DECODER_LAYER, ROPE, LOSS = "norm", "mlp", "experts", "decoder layer", "rotary", "loss"

# (casting mode, weight offset) a norm may compute in, in the order they are preferred on a tie.
NORM_MODES = (("llama", 0.0), ("gemma", 0.0), ("gemma", 1.0), ("llama", 1.0))
# Config fields known to hold the final logit soft-capping, and constant logit scalings with what they do.
SOFTCAP_FIELDS = ("final_logit_softcapping",)
LOGIT_SCALE_FIELDS = (("logits_scaling", "divide"), ("logit_scale", "multiply"))
ACTIVATION_FIELDS = ("hidden_act", "hidden_activation", "activation_function", "hidden_activation_fn")
# Probe input size: a few tokens are enough to see a wrong formula and keep the interpreter quick.
PROBE_BATCH, PROBE_SEQ = 2, 6


@dataclass
class Recognition:
    """What the walk over one model found.

    spec: the proposed table row (None when nothing was recognised). found: part -> how it was recognised
    and its probe's margin. left: part -> why it stays as it is. A part is named "<kind> <ClassName>" (the
    rotary part by its function name).
    """

    model_type: str
    spec: FamilySpec | None
    found: dict[str, str] = field(default_factory=dict)
    left: dict[str, str] = field(default_factory=dict)

    @property
    def share(self) -> str:
        """How much of the family was recognised: "recognised" (every part found), "partly" (some parts
        left) or "not" (nothing found)."""
        if self.spec is None or not self.found:
            return "not"
        return "partly" if self.left else "recognised"


class _Captured(Exception):
    """Raised by a recording hook to stop a forward once it has what it records."""


def recognize(
    model: nn.Module,
    options: PatchOptions | None = None,
    *,
    device: torch.device | str | None = None,
    original_of: Callable[[object, str], Any] = getattr,
) -> Recognition:
    """Recognise the parts of `model` (PEFT-wrapped too) that fusetune's kernels replace, each proven by a
    probe on `device` (default: where the model is, if the kernels run there, else the GPU).

    `original_of(owner, name)` returns an attribute as it was before any patch (patching.py passes its
    registry, so a rotary function another model already shares is probed in its original form).
    """
    return _Walk(unwrap_model(model), options or PatchOptions(), device, original_of).run()


def probe_device(model: nn.Module, requested: torch.device | str | None = None) -> torch.device | None:
    """Where the probes run: `requested`, else the model's own device when the kernels run there (CUDA, or
    anything under the Triton interpreter), else the current GPU; None when there is none."""
    if requested is not None:
        return torch.device(requested)
    parameter = next(model.parameters(), None)
    own = parameter.device if parameter is not None else torch.device("cpu")
    if own.type == "cuda" or (interpreted() and own.type == "cpu"):
        return own
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return None


# -------------------------------------------------------------------------------------------- the walk


class _Walk:
    def __init__(
        self,
        model: nn.Module,
        options: PatchOptions,
        device: torch.device | str | None,
        original_of: Callable[[object, str], Any],
    ) -> None:
        self.model = model
        self.options = options
        self.config = getattr(model, "config", None)
        self.model_type = str(getattr(self.config, "model_type", None) or type(model).__name__)
        self.module: ModuleType = sys.modules[type(model).__module__]
        self.device = probe_device(model, device)
        self.original_of = original_of
        self.found: dict[str, str] = {}
        self.left: dict[str, str] = {}
        self.spec = FamilySpec(
            model_type=self.model_type,
            modeling_module=self.module.__name__,
            causal_lm_class=None,
            norm_classes=(),
            rope_function=None,
        )
        self._copies: dict[object, nn.Module] = {}
        self._layer_inputs: tuple[tuple[Any, ...], dict[str, Any]] | None = None

    def run(self) -> Recognition:
        if self.device is None:
            self.left["model"] = (
                "the kernels run on a CUDA device (or under TRITON_INTERPRET=1), and there is none to probe on"
            )
            return self._result()
        was_training = self.model.training
        try:
            self._step(NORM, self._norms)
            self._step(MLP, self._mlps)
            self._step(EXPERTS, self._experts)
            self._step(LOSS, self._loss)
            layers = self._step(DECODER_LAYER, self._decoder_layers) or []
            if layers:
                self._step(DECODER_LAYER, lambda: self._capture_layer_inputs(layers))
                self._step(ROPE, lambda: self._rope(layers))
                self._step(DECODER_LAYER, lambda: self._decoder_layer(layers))
        finally:
            self.model.train(was_training)
            self._copies.clear()
        return self._result()

    def _step(self, kind: str, step: Callable[[], Any]) -> Any:
        """Run one step of the walk; a step that fails in a way the probes did not foresee leaves its kind
        of part, with the error, instead of failing the caller (a training job, say)."""
        try:
            return step()
        except Exception as error:  # noqa: BLE001 - recognition must never stop a model from training
            message = " ".join(str(error).split())[:200]
            self.left.setdefault(kind, f"recognition raised {type(error).__name__}: {message}")
            return None

    def _result(self) -> Recognition:
        has_part = bool(
            self.spec.norm_classes
            or self.spec.mlp_class
            or self.spec.experts_class
            or self.spec.causal_lm_class
            or self.spec.rope_function
        )
        return Recognition(
            model_type=self.model_type,
            spec=self.spec if has_part else None,
            found=self.found,
            left=self.left,
        )

    # ------------------------------------------------------------------------------------------ helpers

    def _defined_here(self, cls: type) -> bool:
        """Whether the family's modeling module names this class (what a row's names are looked up in)."""
        return getattr(self.module, cls.__name__, None) is cls

    def _on_device(self, module: nn.Module) -> nn.Module:
        """`module` itself when it lives on the probe device, else a copy there (made once per module)."""
        parameter = next(module.parameters(), None)
        if parameter is None or parameter.device == self.device:
            return module
        key = id(module)
        if key not in self._copies:
            self._copies[key] = copy.deepcopy(module).to(self.device)
        return self._copies[key]

    def _in(self, module: nn.Module, dtype: torch.dtype, upcast: bool) -> nn.Module:
        """`module` for a probe call in `dtype` (float32 with `upcast`): the module on the probe device when it
        is in that dtype, else a copy of that in the dtype (made once)."""
        on_device = self._on_device(module)
        target = torch.float32 if upcast else dtype
        parameter = next(on_device.parameters(), None)
        if parameter is None or parameter.dtype == target:
            return on_device
        key = (id(on_device), target)
        if key not in self._copies:
            self._copies[key] = copy.deepcopy(on_device).to(target)
        return self._copies[key]

    def _probe(
        self,
        original: Callable[..., Any],
        replacement: Callable[..., Any],
        make_call: MakeCall,
        outputs: Callable[[Any], Any],
        op: str,
        dtypes: tuple[torch.dtype, ...],
    ) -> ProbeResult:
        """The probe in float32 (sharp) and in each of `dtypes` (the part's own): the first failure, else the
        narrowest pass."""
        worst: ProbeResult | None = None
        for dtype in dict.fromkeys((torch.float32, *dtypes)):
            result = run_probe(original, replacement, make_call, outputs, op, dtype)
            if not result.passed:
                return ProbeResult(False, result.error, f"{result.detail} (in {str(dtype).split('.')[-1]})")
            worst = result if worst is None or result.error > worst.error else worst
        assert worst is not None
        return worst

    def _random(self, shape: tuple[int, ...], dtype: torch.dtype, seed: int, scale: float = 1.0):
        generator = torch.Generator().manual_seed(seed)
        return (torch.randn(shape, generator=generator, device="cpu") * scale).to(self.device, dtype)

    @staticmethod
    def _trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
        return [(name, p) for name, p in module.named_parameters() if p.requires_grad]

    def _modules_by_class(self, accept: Callable[[nn.Module], bool]) -> dict[type, list[nn.Module]]:
        groups: dict[type, list[nn.Module]] = {}
        for module in self.model.modules():
            if accept(module):
                groups.setdefault(type(module), []).append(module)
        return groups

    def _activation_field(self, module: nn.Module) -> tuple[str | None, str]:
        """The config field naming the module's activation, when the kernels have one for it; else why not."""
        config = getattr(module, "config", None)
        if config is None:
            return None, "keeps no config to read its activation from"
        fields = [*ACTIVATION_FIELDS, *(k for k, v in vars(config).items() if isinstance(v, str))]
        for name in dict.fromkeys(fields):
            value = getattr(config, name, None)
            if not isinstance(value, str):
                continue
            kernel = fused.gated_activation_name(value, use_swiglu=True, use_geglu=True)
            if kernel is None:
                continue
            enabled = fused.gated_activation_name(
                value, use_swiglu=self.options.swiglu, use_geglu=self.options.geglu
            )
            if enabled is None:
                return None, f"its activation {value!r} has a kernel, turned off by the options"
            return name, value
        named = [getattr(config, n) for n in ACTIVATION_FIELDS if isinstance(getattr(config, n, None), str)]
        return (
            None,
            f"its activation {named[0]!r} has no fused kernel" if named else "no activation in its config",
        )

    # -------------------------------------------------------------------------------------------- norms

    def _norms(self) -> None:
        def looks_like_norm(module: nn.Module) -> bool:
            own = dict(module.named_parameters(recurse=False))
            return (
                not any(True for _ in module.children())
                and set(own) == {"weight"}
                and own["weight"].dim() == 1
                and "norm" in type(module).__name__.lower()
            )

        accepted: dict[type, tuple[str, float, str, int]] = {}
        for cls, instances in self._modules_by_class(looks_like_norm).items():
            part = f"{NORM} {cls.__name__}"
            if not self.options.rms_norm:
                self.left[part] = "the rms_norm kernel is turned off by the options"
                continue
            if not self._defined_here(cls):
                self.left[part] = f"defined in {cls.__module__}, not in the family's modeling module"
                continue
            eps_names = [
                n for n, v in vars(instances[0]).items() if isinstance(v, float) and "eps" in n.lower()
            ]
            if not eps_names:
                self.left[part] = "no float epsilon attribute to read"
                continue
            outcome = self._norm_mode(instances[0], eps_names[0])
            if isinstance(outcome, str):
                self.left[part] = outcome
                continue
            casting, offset = outcome
            result = self._probe_norm(instances[0], casting, offset, eps_names[0])
            if not result.passed:
                self.left[part] = f"probe failed ({casting} casting, offset {offset:g}): {result.detail}"
                continue
            accepted[cls] = (casting, offset, eps_names[0], len(instances))
            self.found[part] = (
                f"RMSNorm, {casting} casting, weight offset {offset:g}, eps from {eps_names[0]} "
                f"({len(instances)} modules; probe {result.detail})"
            )
        if not accepted:
            return
        # One row holds one norm computation: the one most modules use (others are left, with the reason).
        counts = Counter()
        for casting, offset, eps_name, n in accepted.values():
            counts[(casting, offset, eps_name)] += n
        (casting, offset, eps_name), _ = counts.most_common(1)[0]
        kept = []
        for cls, (c, o, e, _) in accepted.items():
            if (c, o, e) == (casting, offset, eps_name):
                kept.append(cls.__name__)
            else:
                part = f"{NORM} {cls.__name__}"
                self.left[part] = f"computes another way ({c}, offset {o:g}) than the family's other norms"
                self.found.pop(part, None)
        self.spec = dataclasses.replace(
            self.spec,
            norm_classes=tuple(kept),
            norm_casting_mode=casting,
            norm_offset=offset,
            norm_eps_attribute=eps_name,
        )

    def _norm_rows(self, width: int, eps: float, dtype: torch.dtype, seed: int) -> torch.Tensor:
        """[2, 3, width] rows whose scales run from 4 down to sqrt(eps) / 4 (where epsilon is half the mean
        square, so a wrong epsilon moves the output by tens of percent), each with a mean of half its scale
        (which a LayerNorm would take out)."""
        root = math.sqrt(max(eps, 1e-12))
        scales = torch.tensor([4.0, 1.0, 0.25, 4 * root, root, root / 4], device="cpu").view(2, 3, 1)
        generator = torch.Generator().manual_seed(seed)
        rows = (torch.randn(2, 3, width, generator=generator, device="cpu") + 0.5) * scales
        return rows.to(self.device, dtype)

    def _norm_probe_copy(self, norm: nn.Module, weight: torch.Tensor) -> nn.Module:
        probe_norm = copy.copy(norm)  # shares nothing it writes: only `weight` is replaced
        probe_norm._parameters = {"weight": nn.Parameter(weight.clone())}
        return probe_norm

    def _norm_mode(self, norm: nn.Module, eps_name: str) -> tuple[str, float] | str:
        """The (casting mode, offset) whose pure-PyTorch reference gives the norm's own output, or why none."""
        eps = float(getattr(norm, eps_name))
        width = norm.weight.numel()
        scores: dict[tuple[str, float], float] = {}
        worst = ""
        for mode in NORM_MODES:
            total = 0.0
            for dtype in dict.fromkeys((norm.weight.dtype, torch.bfloat16)):
                x = self._norm_rows(width, eps, dtype, seed=11)
                weight = 0.3 + self._random((width,), dtype, seed=12, scale=0.5)
                probe_norm = self._norm_probe_copy(norm, weight)
                try:
                    with torch.no_grad():
                        expected = type(norm).forward(probe_norm, x)
                except Exception as error:  # noqa: BLE001 - a module that cannot run here is left, with why
                    return f"its forward raised {type(error).__name__} on the probe input: {error}"[:300]
                if not isinstance(expected, torch.Tensor):
                    return f"its forward returns {type(expected).__name__}, not a tensor"
                reference = rms_norm_reference(x, weight, eps=eps, offset=mode[1], casting_mode=mode[0])
                result = compare([reference], [expected], ["output"], tolerance_for("rms_norm", dtype))
                total = max(total, result.error)
                if not result.passed:
                    worst = worst or result.detail
                    break
            if total <= 1.0:
                scores[mode] = total
        if not scores:
            return f"not an RMS norm in any casting mode with its epsilon ({worst})"
        return min(scores, key=lambda mode: (scores[mode], NORM_MODES.index(mode)))

    def _probe_norm(self, norm: nn.Module, casting: str, offset: float, eps_name: str) -> ProbeResult:
        spec = dataclasses.replace(
            self.spec, norm_casting_mode=casting, norm_offset=offset, norm_eps_attribute=eps_name
        )
        eps = float(getattr(norm, eps_name))
        width = norm.weight.numel()

        def make_call(dtype: torch.dtype, upcast: bool) -> ProbeCall:
            x = self._norm_rows(width, eps, dtype, seed=21)
            weight = 0.3 + self._random((width,), dtype, seed=22, scale=0.5)
            if upcast:
                x, weight = x.float(), weight.float()
            probe_norm = self._norm_probe_copy(norm, weight)
            x.requires_grad_()
            return ProbeCall((probe_norm, x), {}, [x, probe_norm.weight], ["input", "weight"])

        return self._probe(
            type(norm).forward,
            fused.make_rms_norm_forward(spec),
            make_call,
            first_tensors,
            "rms_norm",
            (norm.weight.dtype, torch.bfloat16),
        )

    # --------------------------------------------------------------------------------------------- MLPs

    def _mlps(self) -> None:
        def looks_like_mlp(module: nn.Module) -> bool:
            children = dict(module.named_children())
            return "down_proj" in children and (
                "gate_up_proj" in children or {"gate_proj", "up_proj"} <= children.keys()
            )

        groups = self._modules_by_class(looks_like_mlp)
        if not groups:
            return
        accepted: list[tuple[type, FamilySpec, int]] = []
        for cls, instances in groups.items():
            part = f"{MLP} {cls.__name__}"
            mlp = instances[0]
            if not self._defined_here(cls):
                self.left[part] = f"defined in {cls.__module__}, not in the family's modeling module"
                continue
            activation_field, activation = self._activation_field(mlp)
            if activation_field is None:
                self.left[part] = f"gated MLP, but {activation}"
                continue
            layout = "fused_gate_up" if "gate_up_proj" in dict(mlp.named_children()) else "split"
            spec = dataclasses.replace(
                self.spec,
                mlp_class=cls.__name__,
                mlp_layout=layout,
                activation_config_attribute=activation_field,
            )
            result = self._probe_mlp(mlp, spec)
            if not result.passed:
                self.left[part] = f"probe failed ({layout}, {activation}): {result.detail}"
                continue
            accepted.append((cls, spec, len(instances)))
            self.found[part] = (
                f"gated MLP, {'one gate_up_proj' if layout == 'fused_gate_up' else 'gate_proj and up_proj'}, "
                f"{activation} from config.{activation_field} ({len(instances)} modules; probe {result.detail})"
            )
        if not accepted:
            return
        cls, spec, _ = max(accepted, key=lambda entry: entry[2])
        for other, _, _ in accepted:
            if other is not cls:
                part = f"{MLP} {other.__name__}"
                self.found.pop(part, None)
                self.left[part] = f"a second MLP class; a row names one ({cls.__name__})"
        self.spec = dataclasses.replace(
            self.spec,
            mlp_class=spec.mlp_class,
            mlp_layout=spec.mlp_layout,
            activation_config_attribute=spec.activation_config_attribute,
        )

    def _probe_mlp(self, mlp: nn.Module, spec: FamilySpec) -> ProbeResult:
        replacement = fused.make_mlp_forward(
            spec, type(mlp).forward, use_swiglu=self.options.swiglu, use_geglu=self.options.geglu
        )
        own = mlp.down_proj.weight.dtype
        hidden = mlp.down_proj.weight.shape[0]

        def make_call(dtype: torch.dtype, upcast: bool) -> ProbeCall:
            probe_mlp = self._in(mlp, dtype, upcast)
            x = self._random((PROBE_BATCH, PROBE_SEQ, hidden), dtype, seed=31)
            x = (x.float() if upcast else x).requires_grad_()
            parameters = self._trainable(probe_mlp)
            return ProbeCall(
                (probe_mlp, x), {}, [x, *(p for _, p in parameters)], ["input", *(n for n, _ in parameters)]
            )

        return self._probe(type(mlp).forward, replacement, make_call, first_tensors, "gated_mlp", (own,))

    # ------------------------------------------------------------------------------------------ experts

    def _experts(self) -> None:
        def looks_like_experts(module: nn.Module) -> bool:
            gate_up = dict(module.named_parameters(recurse=False)).get("gate_up_proj")
            return (
                gate_up is not None
                and gate_up.dim() == 3
                and callable(getattr(type(module), "_apply_gate", None))
            )

        groups = self._modules_by_class(looks_like_experts)
        for cls, instances in groups.items():
            part = f"{EXPERTS} {cls.__name__}"
            experts = instances[0]
            if self.spec.experts_class is not None:
                self.left[part] = f"a second experts class; a row names one ({self.spec.experts_class})"
                continue
            if not self._defined_here(cls):
                self.left[part] = f"defined in {cls.__module__}, not in the family's modeling module"
                continue
            if not getattr(experts, "is_concatenated", True):
                self.left[part] = "gate and up projections are interleaved, not [gate; up] halves"
                continue
            implementation = getattr(getattr(experts, "config", None), "_experts_implementation", None)
            if implementation == "eager":
                self.left[part] = (
                    "the model runs transformers' eager experts loop, which never calls _apply_gate "
                    "(load it with experts_implementation='grouped_mm' to fuse the gate)"
                )
                continue
            activation_field, activation = self._activation_field(experts)
            if activation_field is None:
                self.left[part] = f"experts' gate, but {activation}"
                continue
            spec = dataclasses.replace(
                self.spec, experts_class=cls.__name__, activation_config_attribute=activation_field
            )
            if self.spec.mlp_class is not None and self.spec.activation_config_attribute != activation_field:
                self.left[part] = "reads its activation from another config field than the family's MLP"
                continue
            result = self._probe_experts(experts, spec)
            if not result.passed:
                self.left[part] = f"probe of _apply_gate failed ({activation}): {result.detail}"
                continue
            self.spec = spec
            self.found[part] = (
                f"MoE experts, [gate; up] projection gated by {activation} from config.{activation_field} "
                f"({len(instances)} modules; probe {result.detail})"
            )

    def _probe_experts(self, experts: nn.Module, spec: FamilySpec) -> ProbeResult:
        original = self.original_of(type(experts), "_apply_gate")
        replacement = fused.make_experts_apply_gate(
            spec, original, use_swiglu=self.options.swiglu, use_geglu=self.options.geglu
        )
        gate_up = experts.gate_up_proj
        intermediate = getattr(experts, "intermediate_dim", None) or getattr(
            experts, "intermediate_size", None
        )
        transposed = getattr(experts, "is_transposed", False)
        width = 2 * intermediate if intermediate else gate_up.shape[2 if transposed else 1]

        def make_call(dtype: torch.dtype, upcast: bool) -> ProbeCall:
            projected = self._random((PROBE_BATCH * PROBE_SEQ, width), dtype, seed=41, scale=2.0)
            projected = (projected.float() if upcast else projected).requires_grad_()
            return ProbeCall((experts, projected), {}, [projected], ["gate_up_out"])

        return self._probe(
            original, replacement, make_call, first_tensors, "gated_activation", (gate_up.dtype,)
        )

    # --------------------------------------------------------------------------------------- head + loss

    def _loss(self) -> None:
        model, config = self.model, self.config
        part = f"{LOSS} {type(model).__name__}"
        if not self.options.fused_linear_cross_entropy:
            self.left[part] = "the fused linear cross-entropy is turned off by the options"
            return
        head = getattr(model, "lm_head", None)
        prefix = getattr(model, "base_model_prefix", "")
        base = getattr(model, prefix, None) if prefix else None
        if not isinstance(head, nn.Linear) or not isinstance(base, nn.Module):
            self.left[part] = "no nn.Linear lm_head over a base model named by base_model_prefix"
            return
        if "labels" not in inspect.signature(type(model).forward).parameters:
            self.left[part] = "its forward takes no labels"
            return
        if not self._defined_here(type(model)):
            self.left[part] = f"defined in {type(model).__module__}, not in the family's modeling module"
            return
        softcaps = [n for n in SOFTCAP_FIELDS if getattr(config, n, None) is not None]
        scales = [(n, op) for n, op in LOGIT_SCALE_FIELDS if getattr(config, n, None) is not None]
        router = (
            hasattr(config, "output_router_logits")
            and hasattr(model, "router_aux_loss_coef")
            and callable(getattr(self.module, "load_balancing_loss_func", None))
        )
        candidates = []
        for softcap in [*softcaps[:1], None]:
            for scale in [*scales[:1], None]:
                candidates.append(
                    dataclasses.replace(
                        self.spec,
                        causal_lm_class=type(model).__name__,
                        logit_softcap_config_attribute=softcap,
                        logit_scale_config_attribute=scale[0] if scale else None,
                        logit_scale_operation=scale[1] if scale else "multiply",
                        router_aux_loss=router,
                    )
                )
        failures = []
        for spec in candidates:
            fields = [n for n in (spec.logit_scale_config_attribute,) if n]
            with _neutral_values_moved(config, fields):
                result = self._probe_loss(spec, head)
            if result.passed:
                extras = [f"soft-capping from config.{spec.logit_softcap_config_attribute}"] * bool(
                    spec.logit_softcap_config_attribute
                )
                if spec.logit_scale_config_attribute:
                    extras.append(
                        f"logits {spec.logit_scale_operation} config.{spec.logit_scale_config_attribute}"
                    )
                if spec.router_aux_loss:
                    extras.append("router auxiliary loss")
                self.spec = dataclasses.replace(
                    self.spec,
                    causal_lm_class=spec.causal_lm_class,
                    logit_softcap_config_attribute=spec.logit_softcap_config_attribute,
                    logit_scale_config_attribute=spec.logit_scale_config_attribute,
                    logit_scale_operation=spec.logit_scale_operation,
                    router_aux_loss=spec.router_aux_loss,
                )
                self.found[part] = (
                    f"lm_head + cross-entropy{''.join(', ' + e for e in extras)} (probe {result.detail})"
                )
                return
            failures.append(result.detail)
        if "'_FixedOutputs' object has no attribute" in failures[0]:
            # The stand-in base model has only the outputs: the forward reached inside it (OPT's and BART's
            # call self.model.decoder), which the fused forward, calling the base model whole, does not.
            self.left[part] = "its forward calls a part inside the base model, not the base model itself"
            return
        self.left[part] = f"probe failed: {failures[0]}"

    def _probe_loss(self, spec: FamilySpec, head: nn.Linear) -> ProbeResult:
        model = self.model
        own = head.weight.dtype
        vocab, hidden = head.weight.shape
        original = type(model).forward
        replacement = fused.make_causal_lm_forward(spec, original)
        n_layers = int(getattr(self.config, "num_hidden_layers", 1) or 1)
        n_experts = getattr(model, "num_experts", None)
        extra = {"output_router_logits": True} if spec.router_aux_loss else {}
        generator = torch.Generator().manual_seed(51)
        labels = torch.randint(0, vocab, (PROBE_BATCH, PROBE_SEQ), generator=generator, device="cpu")
        labels[0, :2] = -100
        input_ids = torch.randint(0, vocab, (PROBE_BATCH, PROBE_SEQ), generator=generator, device="cpu")
        router_logits = (
            tuple(
                self._random((PROBE_BATCH * PROBE_SEQ, n_experts), torch.float32, 52 + i)
                for i in range(n_layers)
            )
            if spec.router_aux_loss and isinstance(n_experts, int)
            else None
        )

        def make_call(dtype: torch.dtype, upcast: bool) -> ProbeCall:
            probe_head = self._in(head, dtype, upcast)
            hidden_states = self._random((PROBE_BATCH, PROBE_SEQ, hidden), dtype, seed=53)
            hidden_states = (hidden_states.float() if upcast else hidden_states).requires_grad_()
            clone = _with_children(
                model,
                {model.base_model_prefix: _FixedOutputs(hidden_states, router_logits), "lm_head": probe_head},
            )
            kwargs = {
                "input_ids": input_ids.to(self.device),
                "labels": labels.to(self.device),
                "use_cache": False,
                **extra,
            }
            head_parameters = self._trainable(probe_head)
            return ProbeCall(
                (clone,),
                kwargs,
                [hidden_states, *(p for _, p in head_parameters)],
                ["hidden states", *(f"lm_head.{n}" for n, _ in head_parameters)],
            )

        return self._probe(
            original, replacement, make_call, lambda output: (output.loss,), "causal_lm_loss", (own,)
        )

    # ---------------------------------------------------------------------------------- decoder layers

    def _decoder_layers(self) -> list[nn.Module]:
        names = set(getattr(self.model, "_no_split_modules", None) or ())
        layers = [m for m in self.model.modules() if type(m).__name__ in names]
        if not layers:
            self.left[DECODER_LAYER] = "the model names no decoder layer class (_no_split_modules)"
            return []
        counts = Counter(type(m) for m in layers)
        if len(counts) > 1:
            # A vision tower's layers share the list: the text decoder's have attention and an MLP and are as
            # many as the text config's layers.
            text_config = self.config.get_text_config() if hasattr(self.config, "get_text_config") else None
            n_text_layers = getattr(text_config, "num_hidden_layers", None)

            def rank(cls: type) -> tuple[bool, bool, bool, int]:
                children = dict(next(m for m in layers if type(m) is cls).named_children())
                return (
                    "self_attn" in children and "mlp" in children,
                    counts[cls] == n_text_layers,
                    "decoder" in cls.__name__.lower(),
                    counts[cls],
                )

            layer_class = max(counts, key=rank)
            layers = [m for m in layers if type(m) is layer_class]
        return layers

    def _capture_layer_inputs(self, layers: list[nn.Module]) -> None:
        """The arguments the model hands its first decoder layer, from a short forward stopped there."""
        base = getattr(self.model, self.model.base_model_prefix, self.model)
        captured: dict[str, Any] = {}

        def record(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            captured["args"], captured["kwargs"] = args, kwargs
            raise _Captured

        vocab = int(getattr(self.config, "vocab_size", 0) or 0)
        parameter = next(self.model.parameters())
        generator = torch.Generator().manual_seed(61)
        input_ids = torch.randint(
            3, max(vocab, 4), (PROBE_BATCH, PROBE_SEQ), generator=generator, device="cpu"
        )
        handle = layers[0].register_forward_pre_hook(record, with_kwargs=True)
        self.model.eval()
        try:
            with torch.no_grad():
                base(input_ids=input_ids.to(parameter.device), use_cache=False)
        except _Captured:
            pass
        except Exception as error:  # noqa: BLE001 - reported as the reason the layer parts are left
            self.left[DECODER_LAYER] = f"the base model's forward raised {type(error).__name__}: {error}"[
                :300
            ]
        finally:
            handle.remove()
        if "args" in captured:
            self._layer_inputs = (
                _to_device(captured["args"], self.device),
                _to_device(captured["kwargs"], self.device),
            )

    def _layer_call(
        self, layer: nn.Module, seed: int
    ) -> tuple[tuple[Any, ...], dict[str, Any], torch.Tensor]:
        """Arguments for one call of `layer` (on the probe device): the recorded ones with fresh random
        hidden states of the same shape."""
        assert self._layer_inputs is not None
        args, kwargs = self._layer_inputs
        kwargs = dict(kwargs)
        recorded = args[0] if args else kwargs.pop("hidden_states")
        hidden_states = self._random(tuple(recorded.shape), recorded.dtype, seed)
        return args[1:], kwargs, hidden_states

    def _rope(self, layers: list[nn.Module]) -> None:
        attention = getattr(layers[0], "self_attn", None) or next(
            (c for c in layers[0].children() if "attention" in type(c).__name__.lower()), None
        )
        if attention is None:
            self.left[ROPE] = "no attention module in the decoder layer to look for a rotary function in"
            return
        if self._layer_inputs is None:
            self.left[ROPE] = "the decoder layer's inputs could not be recorded to call it with"
            return
        attention_module = sys.modules[type(attention).__module__]
        forward = inspect.unwrap(type(attention).forward)
        names = [
            name
            for name in getattr(forward, "__code__", None).co_names
            if ("rotary" in name.lower() or "rope" in name.lower())
            and inspect.isfunction(getattr(attention_module, name, None))
        ]
        if not names:
            self.left[ROPE] = f"{type(attention).__name__}.forward calls no module-level rotary function"
            return
        name = names[0]
        part = f"{ROPE} {name}"
        if not self.options.rope:
            self.left[part] = "the rope kernel is turned off by the options"
            return
        if attention_module is not self.module:
            self.left[part] = f"defined in {attention_module.__name__}, not in the family's modeling module"
            return
        original = self.original_of(attention_module, name)
        call = self._record_call(attention_module, name, layers)
        if call is None:
            self.left[part] = "no layer called it on the probe input"
            return
        args, kwargs = call
        if len(args) < 4:
            self.left[part] = f"called with {len(args)} positional arguments, not (q, k, cos, sin)"
            return

        def make_call(dtype: torch.dtype, upcast: bool) -> ProbeCall:
            q, k = (self._random(tuple(t.shape), dtype, seed=71 + i) for i, t in enumerate(args[:2]))
            q, k = ((t.float() if upcast else t).requires_grad_() for t in (q, k))
            angles = _cast_floating(args[2:], torch.float32 if upcast else dtype)
            return ProbeCall((q, k, *angles), dict(kwargs), [q, k], ["q", "k"])

        replacement = fused.make_apply_rotary_pos_emb(original)
        result = self._probe(original, replacement, make_call, first_tensors, "rope", (args[0].dtype,))
        if not result.passed:
            self.left[part] = f"probe failed: {result.detail}"
            return
        self.spec = dataclasses.replace(self.spec, rope_function=name)
        width = args[2].shape[-1]
        self.found[part] = (
            f"rotate-half rotary embedding over {width} of {args[0].shape[-1]} head dims (probe {result.detail})"
        )

    def _record_call(
        self, owner: ModuleType, name: str, layers: list[nn.Module]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """The arguments of the first call of `owner.name` while the first few layers run (some layers of a
        family, SmolLM3's no-rope ones, do not call it)."""
        recorded: dict[str, Any] = {}
        current = getattr(owner, name)

        def recording(*args: Any, **kwargs: Any) -> Any:
            recorded["call"] = (_detached(args), _detached(kwargs))
            raise _Captured

        setattr(owner, name, recording)
        try:
            for index, layer in enumerate(layers[:4]):
                args, kwargs, hidden_states = self._layer_call(layer, seed=81 + index)
                try:
                    with torch.no_grad():
                        type(layer).forward(self._on_device(layer), hidden_states, *args, **kwargs)
                except _Captured:
                    break
                except Exception:  # noqa: BLE001 - a layer that cannot run here: the layer probe says why
                    break
        finally:
            setattr(owner, name, current)
        return recorded.get("call")

    def _decoder_layer(self, layers: list[nn.Module]) -> None:
        layer = layers[0]
        part = f"{DECODER_LAYER} {type(layer).__name__}"
        if DECODER_LAYER in self.left:
            self.left[part] = self.left.pop(DECODER_LAYER)
            return
        if self._layer_inputs is None:
            self.left[part] = "its inputs could not be recorded"
            return
        norm_classes = {getattr(self.module, name) for name in self.spec.norm_classes}
        order = self._call_order(layer, norm_classes)
        if isinstance(order, str):
            self.left[part] = order
            return
        calls = [kind for _, kind in order]
        norms = [name for name, kind in order if kind == "norm"]
        layout = {
            ("norm", "attention", "norm", "mlp"): "prenorm",
            ("norm", "attention", "norm", "norm", "mlp", "norm"): "sandwich",
            ("attention", "norm", "mlp", "norm"): "postnorm",
        }.get(tuple(calls))
        sequence = ", ".join(name for name, _ in order)
        if layout is None:
            self.left[part] = f"layout not recognised: one call runs {sequence}"
            return
        if layout == "postnorm":
            self.found[part] = (
                f"post-norm ({sequence}): each branch is normalised before its residual add, so no add "
                "feeds a norm and nothing is fused; its norms run the kernel on their own"
            )
            return
        if not (self.options.rms_norm and self.options.add_rms_norm):
            self.left[part] = f"{layout}; the add_rms_norm fusion is turned off by the options"
            return
        multipliers = [
            name
            for name, value in vars(layer).items()
            if isinstance(value, float) and not name.startswith("_")
        ]
        failures = []
        with _neutral_values_moved(self._on_device(layer), multipliers):
            found = self._layer_candidates(layer, layout, norms, multipliers, failures)
        if found is not None:
            spec, multiplier, result = found
            self.spec = spec
            scale = f", branches scaled by {multiplier}" if multiplier else ""
            self.found[part] = f"{layout} ({sequence}){scale}; probe {result.detail}"
            return
        self.left[part] = f"probe failed: {'; '.join(failures)}"

    def _layer_candidates(
        self, layer: nn.Module, layout: str, norms: list[str], multipliers: list[str], failures: list[str]
    ) -> tuple[FamilySpec, str | None, ProbeResult] | None:
        """The first fused layer (plain, then with each float attribute as the branch scale) its probe
        passes; each failure's reason appended to `failures`."""
        for multiplier in [None, *multipliers]:
            spec = dataclasses.replace(
                self.spec,
                decoder_layer_class=type(layer).__name__,
                decoder_layout=layout,
                decoder_norm_attributes=None
                if tuple(norms) == DEFAULT_DECODER_NORMS[layout]
                else tuple(norms),
                residual_multiplier_attribute=multiplier,
            )
            result = self._probe_layer(layer, spec)
            if result.passed:
                return spec, multiplier, result
            failures.append(f"{layout}{' x ' + multiplier if multiplier else ''}: {result.detail}")
        return None

    def _call_order(self, layer: nn.Module, norm_classes: set[type]) -> list[tuple[str, str]] | str:
        """(child name, "norm" / "attention" / "mlp") in the order one call of the layer runs them."""
        probe_layer = self._on_device(layer)
        kinds = {}
        for name, child in probe_layer.named_children():
            if name == "self_attn":
                kinds[name] = "attention"
            elif name == "mlp":
                kinds[name] = "mlp"
            elif type(child) in norm_classes:
                kinds[name] = "norm"
            elif "norm" in name.lower():
                return f"its {name} is not a recognised RMS norm ({type(child).__name__})"
        if "attention" not in kinds.values() or "mlp" not in kinds.values():
            return "the fused layer needs children named self_attn and mlp"
        order: list[tuple[str, str]] = []
        hooks = [
            getattr(probe_layer, name).register_forward_hook(
                lambda *_, name=name: order.append((name, kinds[name]))
            )
            for name in kinds
        ]
        args, kwargs, hidden_states = self._layer_call(layer, seed=91)
        try:
            with torch.no_grad():
                type(layer).forward(probe_layer, hidden_states, *args, **kwargs)
        except Exception as error:  # noqa: BLE001 - reported as the reason
            return f"its forward raised {type(error).__name__} on the recorded inputs: {error}"[:300]
        finally:
            for hook in hooks:
                hook.remove()
        return order

    def _probe_layer(self, layer: nn.Module, spec: FamilySpec) -> ProbeResult:
        try:
            replacement = fused.make_decoder_layer_forward(
                spec, use_swiglu=self.options.swiglu, use_geglu=self.options.geglu
            )
        except (AttributeError, ValueError) as error:
            return ProbeResult.failure(str(error))
        own = next(layer.parameters()).dtype

        def make_call(dtype: torch.dtype, upcast: bool) -> ProbeCall:
            probe_layer = self._in(layer, dtype, upcast)
            args, kwargs, hidden_states = self._layer_call(layer, seed=101)
            if upcast or dtype != own:
                target = torch.float32 if upcast else dtype
                args, kwargs = _cast_floating(args, target), _cast_floating(kwargs, target)
                hidden_states = hidden_states.to(dtype).to(target)
            hidden_states.requires_grad_()
            parameters = self._trainable(probe_layer)
            return ProbeCall(
                (probe_layer, hidden_states, *args),
                kwargs,
                [hidden_states, *(p for _, p in parameters)],
                ["hidden states", *(n for n, _ in parameters)],
            )

        return self._probe(
            type(layer).forward,
            replacement,
            make_call,
            lambda output: first_tensors(output)[:1],
            "decoder_layer",
            (own,),
        )


# ------------------------------------------------------------------------------------------- helpers


class _FixedOutputs(nn.Module):
    """Stands in for a base model: returns the given last hidden states (and router logits), whatever the
    input, so that a causal LM's head and loss can be probed alone."""

    def __init__(self, hidden_states: torch.Tensor, router_logits: tuple[torch.Tensor, ...] | None) -> None:
        super().__init__()
        self.hidden_states = hidden_states
        self.router_logits = router_logits

    def forward(self, *args: Any, **kwargs: Any) -> _Outputs:
        return _Outputs(last_hidden_state=self.hidden_states, router_logits=self.router_logits)


class _Outputs:
    """A base model's output as causal LMs read it: by attribute (None for any field it does not hold, as
    ModelOutput gives for fields not set) or by position over the fields that are set."""

    def __init__(self, **fields: Any) -> None:
        self._fields = {name: value for name, value in fields.items() if value is not None}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self.__dict__["_fields"].get(name)

    def __getitem__(self, key: int | str) -> Any:
        return self._fields[key] if isinstance(key, str) else list(self._fields.values())[key]

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def to_tuple(self) -> tuple[Any, ...]:
        return tuple(self._fields.values())


@contextlib.contextmanager
def _neutral_values_moved(owner: object, names: list[str]) -> Iterator[None]:
    """Attributes of `owner` that hold exactly 1.0 set to 0.5 for the duration: a scale at its neutral value
    gives the same numbers whether or not a replacement applies it, so a probe could not tell."""
    moved = {name: getattr(owner, name) for name in names if getattr(owner, name, None) == 1.0}
    for name in moved:
        setattr(owner, name, 0.5)
    try:
        yield
    finally:
        for name, value in moved.items():
            setattr(owner, name, value)


def _with_children(model: nn.Module, children: dict[str, nn.Module]) -> nn.Module:
    """A shallow copy of `model`, in training mode, whose named children are replaced; the model itself is
    untouched."""
    clone = copy.copy(model)
    clone._modules = {**model._modules, **children}
    clone.training = True
    return clone


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device)
    if isinstance(value, tuple):
        return tuple(_to_device(v, device) for v in value)
    if isinstance(value, list):
        return [_to_device(v, device) for v in value]
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """`value` with its floating-point tensors (in tuples, lists and dicts too) cast to `dtype`."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floating(v, dtype) for k, v in value.items()}
    return value


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


def iter_parts(recognition: Recognition) -> Iterator[tuple[str, str, str]]:
    """(part, "found" / "left", what) for each part, found first."""
    for part, what in recognition.found.items():
        yield part, "found", what
    for part, what in recognition.left.items():
        yield part, "left", what
