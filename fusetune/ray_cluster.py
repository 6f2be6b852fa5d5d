"""The Ray cluster as fusetune plans jobs on it (FUSETUNE_RAY_ADDRESS): its nodes, and how a job's ranks are
laid out over them.

A job of `n_gpus` ranks runs the same number of ranks on each of its nodes (one torchrun per node, see
fusetune/worker/ray_engine.py), on as few nodes as hold it: ranks on one node talk through its memory, ranks on
two through the network. `plan_nodes` is the one place that decides the layout; the API calls it at creation
(to refuse only a job the cluster can never hold) and the worker at submission (to tell the job's driver the
layout).

On a cluster with GPUs a rank is a GPU; on a cluster without any (the CPU tests), a rank is a CPU and the ranks
use gloo, as today's local torchrun does on a CPU host.

Imported by the API (through fusetune.capacity) and the worker; `ray` itself is the optional `ray` extra, so it
is imported only when a cluster is read.
"""

from __future__ import annotations

from dataclasses import dataclass

# How long reading the cluster's nodes from its dashboard may take before job creation goes on without it.
READ_TIMEOUT_S = 10


class ClusterTooSmall(ValueError):
    """The job can never run on this cluster as it is; the message names what the cluster has."""


@dataclass(frozen=True)
class ClusterShape:
    # "GPU", or "CPU" on a cluster without GPUs.
    unit: str
    # For every alive node, the number of `unit`s it has (a node without any: 0).
    slots_per_node: tuple[int, ...]

    def describe(self) -> str:
        nodes = [slots for slots in self.slots_per_node if slots > 0]
        per_node = ", ".join(str(slots) for slots in sorted(nodes, reverse=True))
        return f"{sum(nodes)} {self.unit}s on {len(nodes)} node{'s' if len(nodes) != 1 else ''} ({per_node} per node)"


@dataclass(frozen=True)
class NodePlan:
    nnodes: int
    nproc_per_node: int
    unit: str

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def shape_from_resources(per_node_resources: list[dict[str, float]]) -> ClusterShape:
    """The shape of a cluster from each alive node's total resources (Ray's `resources_total`)."""
    has_gpus = any(resources.get("GPU", 0) >= 1 for resources in per_node_resources)
    unit = "GPU" if has_gpus else "CPU"
    return ClusterShape(unit, tuple(int(resources.get(unit, 0)) for resources in per_node_resources))


def plan_nodes(n_ranks: int, shape: ClusterShape) -> NodePlan:
    """The fewest nodes that hold `n_ranks` ranks, the same number on each; ClusterTooSmall if none do."""
    usable = sorted((slots for slots in shape.slots_per_node if slots > 0), reverse=True)
    for nnodes in range(1, len(usable) + 1):
        if n_ranks % nnodes == 0 and usable[nnodes - 1] >= n_ranks // nnodes:
            return NodePlan(nnodes, n_ranks // nnodes, shape.unit)
    total = sum(usable)
    if n_ranks > total:
        raise ClusterTooSmall(f"n_gpus {n_ranks} exceeds the cluster's {shape.describe()}.")
    raise ClusterTooSmall(
        f"n_gpus {n_ranks} cannot be split evenly over the nodes of the cluster's {shape.describe()}: "
        "a job runs the same number of ranks on each of its nodes."
    )


def read_cluster(address: str, timeout_s: int = READ_TIMEOUT_S) -> ClusterShape:
    """The alive nodes of the cluster whose dashboard (the Job Submission address) is at `address`."""
    from ray.util.state import list_nodes

    nodes = list_nodes(
        address=address, filters=[("state", "=", "ALIVE")], timeout=timeout_s, raise_on_missing_output=False
    )
    return shape_from_resources([dict(node.resources_total or {}) for node in nodes])
