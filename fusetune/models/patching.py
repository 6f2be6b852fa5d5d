"""Apply and revert fusetune's kernels on Hugging Face models, following the table in `families.py`.

Two targets:
- a model_type string: the family's classes are patched in place (their `forward`, the experts'
  `_apply_gate`, the module-level rotary function), so every model of that family, built before or after,
  runs the kernels until the handle is reverted;
- a built model (PEFT-wrapped included): each matching module instance is switched to a same-named subclass
  whose forward is fused, so other models in the process are untouched and the state dict, `isinstance`
  checks and LoRA layers inside the modules all stay as they were. The rotary function is module-level in
  transformers, so it is the one shared piece; it is reference-counted and restored when its last user
  reverts.

A built model whose family has no row is recognised by its structure first (`recognize.py`): the parts found
and proven make a `FamilySpec` like a row's, patched on the instance as above.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

# The submodules by their full names: `from fusetune.models import ...` would import the package, whose
# __init__ imports this module.
import fusetune.models.attention as attention
import fusetune.models.fused as fused
import fusetune.models.recognize as recognize
from fusetune.models.families import FamilySpec, family_for
from fusetune.models.options import PatchOptions
from fusetune.models.wrappers import unwrap_model


@dataclass
class FusetuneHandle:
    """What one `apply_fusetune` call replaced, and how to put it back.

    source: "table" (the family's row in families.py), "structure" (recognised by recognize.py; `spec` is
    the row it amounts to) or None (nothing patched). left: the parts that stay as they are, and why (for a
    family recognised by structure, or one that was not recognised).
    """

    model_type: str | None
    options: PatchOptions
    patched: dict[str, int] = field(default_factory=dict)  # "LlamaRMSNorm.forward" -> how many modules
    source: str | None = None
    spec: FamilySpec | None = None
    left: dict[str, str] = field(default_factory=dict)
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    @property
    def active(self) -> bool:
        return bool(self._undo)

    def revert(self) -> None:
        """Restore everything this call replaced; calling it twice does nothing the second time."""
        while self._undo:
            self._undo.pop()()

    def _record(self, what: str, count: int = 1) -> None:
        self.patched[what] = self.patched.get(what, 0) + count


class _SharedAttributes:
    """Reference-counted replacement of attributes of shared objects (classes, modules).

    The first user sets the replacement, the last one to release restores the original, so handles can be
    reverted in any order.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[int, str], list[Any]] = {}  # -> [owner, had_own, original, users]

    def acquire(self, owner: object, name: str, make_replacement: Callable[[Any], Any]) -> Callable[[], None]:
        key = (id(owner), name)
        entry = self._entries.get(key)
        if entry is None:
            own = vars(owner)
            had_own = name in own
            original = own[name] if had_own else getattr(owner, name)
            setattr(owner, name, make_replacement(original))
            entry = self._entries[key] = [owner, had_own, original, 0]
        entry[3] += 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            entry[3] -= 1
            if entry[3] == 0:
                del self._entries[key]
                if entry[1]:
                    setattr(owner, name, entry[2])
                else:
                    delattr(owner, name)

        return release

    def original(self, owner: object, name: str) -> Any:
        """The attribute as it was before any fusetune patch."""
        entry = self._entries.get((id(owner), name))
        return entry[2] if entry is not None else vars(owner).get(name, getattr(owner, name))


_shared = _SharedAttributes()
_fused_subclasses: dict[tuple[Any, ...], type] = {}
_instance_handles: weakref.WeakKeyDictionary[nn.Module, FusetuneHandle] = weakref.WeakKeyDictionary()
_type_handles: dict[str, list[FusetuneHandle]] = {}


def apply_fusetune(
    model_or_model_type: nn.Module | str,
    *,
    rope: bool = True,
    rms_norm: bool = True,
    swiglu: bool = True,
    geglu: bool = True,
    add_rms_norm: bool = True,
    fused_linear_cross_entropy: bool = True,
    varlen_attention: bool = True,
    strict: bool = True,
    recognize_structure: bool = True,
    probe_device: torch.device | str | None = None,
) -> FusetuneHandle:
    """Switch a model, or a whole model family, to fusetune's kernels; returns the handle that reverts it.

    `model_or_model_type` is a `config.model_type` ("llama", "qwen2", "gemma3_text", ...), whose classes
    are patched before loading, or a built model, patched in place (a PEFT model is unwrapped with
    `get_base_model()`).

    A built model whose family has no row in the table is recognised by its structure (recognize.py, with
    `recognize_structure`): each part found is proven equal to the original by a probe on `probe_device`
    (default: the model's device if the kernels run there, else the GPU) and patched; the handle's `left`
    says what stayed as it is and why. A family with neither a row nor a recognised part (or a model_type
    string without a row) raises ValueError naming the supported ones; with `strict=False` it warns instead
    and leaves the model as it is (the returned handle is then empty).
    """
    options = PatchOptions(
        rope=rope,
        rms_norm=rms_norm,
        swiglu=swiglu,
        geglu=geglu,
        add_rms_norm=add_rms_norm,
        fused_linear_cross_entropy=fused_linear_cross_entropy,
        varlen_attention=varlen_attention,
    )
    if isinstance(model_or_model_type, str):
        model_type, model = model_or_model_type, None
    else:
        model = unwrap_model(model_or_model_type)
        model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model is not None:
        previous = _instance_handles.get(model)
        if previous is not None and previous.active:
            raise RuntimeError("this model is already patched by fusetune; revert_fusetune(model) first")
    try:
        spec = family_for(model_type)
    except ValueError as error:
        recognition = None
        if model is not None and recognize_structure:
            recognition = recognize.recognize(
                model, options, device=probe_device, original_of=_shared.original
            )
            if recognition.spec is not None:
                handle = FusetuneHandle(
                    model_type=model_type,
                    options=options,
                    source="structure",
                    spec=recognition.spec,
                    left=dict(recognition.left),
                )
                _patch_instance(model, recognition.spec, options, handle)
                _instance_handles[model] = handle
                return handle
        message = str(error)
        if recognition is not None:
            reasons = "; ".join(f"{part}: {why}" for part, why in recognition.left.items())
            message += f"; and no part of it was recognised by structure ({reasons or 'no part found'})"
        if strict:
            raise ValueError(message) from None
        warnings.warn(f"{message}; the model runs without fusetune kernels", stacklevel=2)
        return FusetuneHandle(
            model_type=model_type, options=options, left=dict(recognition.left) if recognition else {}
        )

    handle = FusetuneHandle(model_type=model_type, options=options, source="table", spec=spec)
    if model is None:
        _patch_classes(spec, options, handle)
        _type_handles.setdefault(model_type, []).append(handle)
    else:
        _patch_instance(model, spec, options, handle)
        _instance_handles[model] = handle
    return handle


def revert_fusetune(target: FusetuneHandle | nn.Module | str) -> None:
    """Undo `apply_fusetune`: given its handle, the patched model (or its PEFT wrapper), or a model_type
    (reverts every class patch of that family)."""
    if isinstance(target, FusetuneHandle):
        target.revert()
    elif isinstance(target, str):
        for handle in _type_handles.pop(target, []):
            handle.revert()
    else:
        handle = _instance_handles.pop(unwrap_model(target), None)
        if handle is not None:
            handle.revert()


def fusetune_handle(model: nn.Module) -> FusetuneHandle | None:
    """The handle of the patch applied to this model instance, if any."""
    return _instance_handles.get(unwrap_model(model))


# ------------------------------------------------------------------------------------------- classes


def _patch_classes(spec: FamilySpec, options: PatchOptions, handle: FusetuneHandle) -> None:
    def patch(owner: object, name: str, make_replacement: Callable[[Any], Any]) -> None:
        handle._undo.append(_shared.acquire(owner, name, make_replacement))
        handle._record(f"{getattr(owner, '__name__', owner)}.{name}")

    if options.rms_norm:
        for class_name in spec.norm_classes:
            patch(spec.resolve(class_name), "forward", lambda _original: fused.make_rms_norm_forward(spec))
    if options.rope and spec.rope_function:
        patch(spec.module(), spec.rope_function, fused.make_apply_rotary_pos_emb)
    gated = {"use_swiglu": options.swiglu, "use_geglu": options.geglu}
    if spec.mlp_class and (options.swiglu or options.geglu):
        patch(
            spec.resolve(spec.mlp_class),
            "forward",
            lambda original: fused.make_mlp_forward(spec, original, **gated),
        )
    if spec.experts_class and (options.swiglu or options.geglu):
        patch(
            spec.resolve(spec.experts_class),
            "_apply_gate",
            lambda original: fused.make_experts_apply_gate(spec, original, **gated),
        )
    if _fuses_decoder_layer(spec, options):
        layer_class = spec.resolve(spec.decoder_layer_class)
        # Deriving a throwaway subclass lets transformers' own class machinery wrap the new forward (5.2x
        # wraps each GradientCheckpointingLayer's forward for checkpointing in __init_subclass__).
        wrapped = _fused_subclass(layer_class, "decoder_layer", spec, options).__dict__["forward"]
        patch(layer_class, "forward", lambda _original: wrapped)
    if options.varlen_attention:
        # Classes keep the attention implementation a model is loaded with; this makes
        # attn_implementation="fusetune_varlen" one to load with.
        attention.register_varlen_attention()
    if options.fused_linear_cross_entropy and spec.causal_lm_class:
        patch(
            spec.resolve(spec.causal_lm_class),
            "forward",
            lambda original: fused.make_causal_lm_forward(spec, original),
        )


# ----------------------------------------------------------------------------------------- instances


def _patch_instance(
    model: nn.Module, spec: FamilySpec, options: PatchOptions, handle: FusetuneHandle
) -> None:
    roles: list[tuple[type, str]] = []
    if options.rms_norm:
        roles += [(spec.resolve(name), "norm") for name in spec.norm_classes]
    if spec.mlp_class and (options.swiglu or options.geglu):
        roles.append((spec.resolve(spec.mlp_class), "mlp"))
    if spec.experts_class and (options.swiglu or options.geglu):
        roles.append((spec.resolve(spec.experts_class), "experts"))
    if _fuses_decoder_layer(spec, options):
        roles.append((spec.resolve(spec.decoder_layer_class), "decoder_layer"))
    if options.fused_linear_cross_entropy and spec.causal_lm_class:
        roles.append((spec.resolve(spec.causal_lm_class), "causal_lm"))

    def applies(module: nn.Module, role: str) -> bool:
        if role in ("mlp", "experts"):  # only MLPs whose activation has a kernel that is switched on
            activation = fused.activation_of(module, spec)
            kernel = fused.gated_activation_kernel(
                activation, use_swiglu=options.swiglu, use_geglu=options.geglu
            )
            if kernel is None:
                return False
        if role == "experts":  # transformers' "eager" experts loop never calls `_apply_gate`
            return getattr(module.config, "_experts_implementation", None) != "eager"
        return True

    for module in model.modules():
        for hf_class, role in roles:
            if isinstance(module, hf_class) and not _is_fused(type(module)) and applies(module, role):
                _switch_class(module, _fused_subclass(type(module), role, spec, options), handle)
                handle._record(f"{hf_class.__name__}.{_ROLE_ATTRIBUTE[role]}")
                break

    if options.rope and spec.rope_function:
        release = _shared.acquire(spec.module(), spec.rope_function, fused.make_apply_rotary_pos_emb)
        handle._undo.append(release)
        # The rotary function is module-level: a model freed without `revert_fusetune` gives its share back,
        # or every later model of the family in the process (unpatched ones included) would keep the kernel.
        weakref.finalize(model, release)
        handle._record(f"{spec.modeling_module}.{spec.rope_function}")

    if options.varlen_attention:
        previous = attention.switch_to_varlen_attention(model)
        if previous is not None:
            # A weak reference: the handle lives in `_instance_handles`, keyed weakly by this model, so a
            # strong one here would keep the model (and its weights) alive for the life of the process.
            model_ref = weakref.ref(model)

            def restore_attention() -> None:
                live = model_ref()
                if live is not None:
                    live.set_attn_implementation(previous)

            handle._undo.append(restore_attention)
            handle._record(f"attention: {attention.VARLEN_ATTENTION}")


def _switch_class(module: nn.Module, fused_class: type, handle: FusetuneHandle) -> None:
    original_class = type(module)
    module.__class__ = fused_class
    # Weakly: the handle must not keep the model alive (see `_patch_instance`); a freed module needs no undo.
    module_ref = weakref.ref(module)

    def undo() -> None:
        module = module_ref()
        if module is None:
            return
        if type(module) is fused_class:
            module.__class__ = original_class
        else:  # something (FSDP, a wrapper) re-classed the module after patching; leave it be
            warnings.warn(
                f"cannot revert {original_class.__name__}: its class changed to {type(module).__name__}",
                stacklevel=3,
            )

    handle._undo.append(undo)


_ROLE_ATTRIBUTE = {
    "norm": "forward",
    "mlp": "forward",
    "experts": "_apply_gate",
    "decoder_layer": "forward",
    "causal_lm": "forward",
}


def _is_fused(cls: type) -> bool:
    return "_fusetune_original_class" in vars(cls)


def _fuses_decoder_layer(spec: FamilySpec, options: PatchOptions) -> bool:
    return bool(
        options.rms_norm and options.add_rms_norm and spec.decoder_layer_class and spec.decoder_layout
    )


def _fused_subclass(base: type, role: str, spec: FamilySpec, options: PatchOptions) -> type:
    """A subclass of `base` with the same name whose `role` attribute is fused (cached per combination).

    The same `__name__`, `__qualname__` and `__module__` keep what transformers derives from them (the
    `architectures` written by save_pretrained, `_no_split_modules`, source heuristics) unchanged.
    """
    key = (base, role, spec, options)
    cached = _fused_subclasses.get(key)
    if cached is not None:
        return cached
    attribute = _ROLE_ATTRIBUTE[role]
    gated = {"use_swiglu": options.swiglu, "use_geglu": options.geglu}

    # The original is looked up on the base at call time, so a later class-level patch of the base is seen.
    def original(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return getattr(base, attribute)(self, *args, **kwargs)

    if role == "norm":
        replacement = fused.make_rms_norm_forward(spec)
    elif role == "mlp":
        replacement = fused.make_mlp_forward(spec, original, **gated)
    elif role == "experts":
        replacement = fused.make_experts_apply_gate(spec, original, **gated)
    elif role == "decoder_layer":
        replacement = fused.make_decoder_layer_forward(spec, **gated)
    elif role == "causal_lm":
        original_forward = _shared.original(base, "forward")
        replacement = fused.make_causal_lm_forward(spec, original_forward)
    else:
        raise ValueError(f"unknown role {role!r}")

    namespace = {
        attribute: replacement,
        "_fusetune_original_class": base,
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "__doc__": base.__doc__,
    }
    subclass = type(base.__name__, (base,), namespace)
    _fused_subclasses[key] = subclass
    return subclass
