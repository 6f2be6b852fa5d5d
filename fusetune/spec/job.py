"""A job's specification: its method and its hyperparameters, every value decided, as the job row stores it."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from fusetune.spec.hyperparameters import HyperparametersRequest, JobHyperparameters, Spec, SpecError
from fusetune.spec.methods import METHOD_SPEC, METHODS, MethodRequest, MethodSpec, method_spec
from fusetune.spec.precision import AUTO, OPTIMIZERS, PRECISIONS


class JobSpec(Spec):
    """A job's method and hyperparameters (the method under the "method" key of the row's `hyperparameters`
    column; rows from before methods existed are supervised)."""

    method: MethodSpec = Field(default_factory=method_spec)
    hyperparameters: JobHyperparameters = JobHyperparameters()

    def to_row(self) -> dict[str, Any]:
        method = self.method.model_dump(mode="json", exclude_none=True)
        return {**self.hyperparameters.model_dump(mode="json"), "method": method}

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> JobSpec:
        values = dict(row)
        method = values.pop("method", None) or {}
        return cls(method=METHOD_SPEC.validate_python(method), hyperparameters=JobHyperparameters(**values))

    @classmethod
    def from_request(
        cls,
        method: MethodRequest | None,
        hyperparameters: HyperparametersRequest | None,
        example_count: int,
        base_learning_rate: float,
    ) -> JobSpec:
        """The job a request asks for, "auto" decided for a training file of `example_count` examples. Raises
        SpecError, naming the field, for a combination no trainer can run."""
        if method is not None and hyperparameters is not None and method.hyperparameters() is not None:
            raise SpecError(
                "hyperparameters",
                f"give hyperparameters either at the top level or in method.{method.type}, not both",
            )
        requested = (
            hyperparameters or (method.hyperparameters() if method else None) or HyperparametersRequest()
        )
        resolved = requested.resolve(example_count, base_learning_rate)
        spec = method.spec() if method is not None else method_spec()
        if resolved.packing and not METHODS[spec.type].supports_packing:
            raise SpecError("hyperparameters.packing", f"packing is not available with method {spec.type}.")
        refusal = METHODS[spec.type].fsdp_refusal
        if resolved.distributed == "fsdp" and resolved.n_gpus > 1 and refusal:
            raise SpecError(
                "hyperparameters.distributed",
                f"distributed fsdp is not available with method {spec.type}: {refusal}.",
            )
        if resolved.distributed == "fsdp" and resolved.n_gpus > 1 and resolved.precision != AUTO:
            optimizer = OPTIMIZERS[PRECISIONS[resolved.precision].optimizer]
            if not optimizer.supports_fsdp:
                raise SpecError(
                    "hyperparameters.precision",
                    f"precision {resolved.precision} does not run under FSDP: its optimizer ({optimizer.name}) "
                    "updates whole tensors, not shards; use distributed ddp or another precision.",
                )
        if resolved.optimizer_state_on_host:
            if resolved.distributed == "fsdp" and resolved.n_gpus > 1:
                raise SpecError(
                    "hyperparameters.optimizer_state_on_host",
                    "optimizer_state_on_host does not run with distributed fsdp, which shards the optimizer's "
                    "state over the GPUs already; use distributed ddp, or more GPUs.",
                )
            optimizer = (
                OPTIMIZERS[PRECISIONS[resolved.precision].optimizer] if resolved.precision != AUTO else None
            )
            if optimizer is not None and not optimizer.supports_host_state:
                raise SpecError(
                    "hyperparameters.optimizer_state_on_host",
                    f"precision {resolved.precision}'s optimizer ({optimizer.name}) cannot keep its state in host "
                    "memory; use precision bf16-sr, bf16-sr-8bit, fp8 or fp8-8bit.",
                )
        return cls(method=spec, hyperparameters=resolved)
