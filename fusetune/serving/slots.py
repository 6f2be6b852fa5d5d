"""The serving engine's KV cache: fixed-size slots that every decoding step runs at one shape.

Per loaded model, each layer's keys and values are one tensor [slots, kv_heads, columns, head_dim], allocated once
at the first request. A sequence in flight owns one slot (a row). A decoding step runs every slot, busy or free, as
one batch [slots, 1] with per-row position ids and a boolean mask [slots, 1, 1, columns] of the columns each row
attends to, so the step has one shape: on a GPU it is compiled once and replayed (fusetune/serving/engine.py).

The layout: one write column, shared by all rows, that advances by one each step, used as a ring (mod columns).
The step writes every row's new key and value at that column (one `index_copy_` per layer for the whole batch, the
way a static cache writes, so the compiled step reads a single column index and never a per-row one). A row's
tokens may sit at any columns because RoPE already put each token's position into its key: attention over a set of
keys does not depend on where they are stored. A request's prompt is prefilled alone (eager, its own length) and its
keys and values are copied into its row at the columns just before the write column, so the next step appends
right after them. A row's columns stay contiguous on the ring, and a row never holds more tokens than there are
columns (the engine caps prompt plus completion at the column count), so the write column never lands on a column
the row still uses.

Why not one write position per row (a [slots] cache_position): the cache write would become a scatter with a
per-row index and Hugging Face's caches write one position range for the whole batch; the shared column needs
nothing but transformers' own static layer with the column swapped in. Every layer is a full-attention layer
over the slot: the step's mask is the one every layer reads, so a sliding-window layer attends beyond its window
once a sequence outgrows it (the README's limits say so).

A free row's mask keeps only the current column (its own throwaway token): a row that attends to nothing gives NaN
in scaled_dot_product_attention's fallback (the CPU, float32), and a NaN value left in the cache would reach a later
owner of the row through a masked-out column (0 x NaN). The decode kernel (fusetune/kernels/decode_attention.py)
skips every block of cache columns a row's mask leaves out, so the unused columns of the ring cost nothing to read.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, StaticLayer

from fusetune.serving.sampling import uniforms


class _SlotLayer(StaticLayer):
    """One layer's slot tensors, written at the shared column (a 1-element tensor of a fixed address)."""

    def __init__(
        self, like_keys: torch.Tensor, like_values: torch.Tensor, columns: int, column: torch.Tensor
    ):
        super().__init__(max_cache_len=columns)
        # transformers' own allocation ([slots, kv_heads, columns, head_dim] from states shaped [slots, kv_heads, 1,
        # head_dim]), so the tensors are marked as static addresses as its static cache's are: what lets a compiled
        # step run under CUDA graphs with the cache written in place.
        self.lazy_initialization(like_keys, like_values)
        self.column = column

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        self.keys.index_copy_(2, self.column, key_states)
        self.values.index_copy_(2, self.column, value_states)
        return self.keys, self.values


class SlotCache(Cache):
    """The layers' slot tensors and the shared write column (see the module docstring)."""

    def __init__(self, layers: list[_SlotLayer], column: torch.Tensor):
        super().__init__(layers=layers)
        self.column = column


# How a GPU compiles the decoding step. CUDA graphs ("reduce-overhead"): a decoding step of a 1B model is hundreds
# of small kernels whose launch time exceeds their run time at a few dozen rows; one graph replay launches them all.
# The step's shape never changes and every input lives at a fixed address, which is what the graphs need. Not
# fullgraph: a graph break costs a split graph, not the requests (tests/serving/test_slots.py checks on CPU that
# the step traces as one graph and never recompiles).
CUDA_STEP_COMPILE: dict[str, Any] = {"mode": "reduce-overhead", "dynamic": False}


class SlotBatch:
    """The slots of one loaded model: the cache, the step's inputs (kept at fixed addresses and updated in place,
    so a compiled step reads them without a copy) and which sequence owns which row."""

    def __init__(self, model: Any, slots: int, columns: int, compile_options: dict[str, Any] | None):
        self.model = model
        self.slots, self.columns = slots, columns
        self.device = next(model.parameters()).device
        self.owners: list[Any | None] = [None] * slots
        self.write_column = 0  # the next step's column, on the host
        self.cache: SlotCache | None = None  # allocated at the first prefill, from its keys' shapes and dtype
        # The step queued on the device whose tokens the engine has not read yet: (tokens, [(row, owner)] at launch).
        self.in_flight: tuple[torch.Tensor, list[tuple[int, Any]]] | None = None
        self.input_ids = torch.zeros((slots, 1), dtype=torch.long, device=self.device)
        self.position_ids = torch.zeros((slots, 1), dtype=torch.long, device=self.device)
        self.mask = torch.zeros((slots, 1, 1, columns), dtype=torch.bool, device=self.device)
        self.busy = torch.zeros(slots, dtype=torch.bool, device=self.device)
        self.column = torch.zeros(1, dtype=torch.long, device=self.device)
        # Each row's sampling (fusetune/serving/sampling.py), on the device so a step draws every row's token without
        # a copy from the host: temperature (0: greedy), top_p, the uniform number of each of its completion's token
        # indices (at most the columns: the engine caps prompt plus completion at them), computed from the seed when
        # the row is placed (the hash is some 80 small operations, once per completion rather than once per step),
        # and its next token's index.
        self.temperature = torch.zeros(slots, dtype=torch.float32, device=self.device)
        self.top_p = torch.ones(slots, dtype=torch.float32, device=self.device)
        self.uniforms = torch.zeros((slots, columns), dtype=torch.float64, device=self.device)
        self.counter = torch.zeros(slots, dtype=torch.long, device=self.device)
        for tensor in (self.input_ids, self.position_ids, self.mask, self.column):
            torch._dynamo.mark_static_address(tensor)
        self._step = self._forward
        self._cuda_graphs = compile_options is not None and compile_options.get("mode") == "reduce-overhead"
        if compile_options is not None:
            self._step = torch.compile(self._forward, **compile_options)

    @property
    def free_rows(self) -> list[int]:
        return [row for row, owner in enumerate(self.owners) if owner is None]

    @property
    def busy_rows(self) -> int:
        return sum(owner is not None for owner in self.owners)

    def _forward(self) -> torch.Tensor:
        output = self.model(
            input_ids=self.input_ids, position_ids=self.position_ids, attention_mask=self.mask,
            # transformers 5.24 renamed the argument `cache` but still takes this name (with a warning, once); earlier
            # 5.x and fusetune's fused forward (fusetune/models/fused.py) take only this one.
            past_key_values=self.cache, use_cache=True,
        )  # fmt: skip
        return output.logits[:, -1, :]

    def _allocate(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        cache_layers = []
        for keys, values in layers:
            like_keys = keys.new_empty((self.slots, keys.shape[1], 1, keys.shape[3]))
            like_values = values.new_empty((self.slots, values.shape[1], 1, values.shape[3]))
            cache_layers.append(_SlotLayer(like_keys, like_values, self.columns, self.column))
        self.cache = SlotCache(cache_layers, self.column)

    def place(
        self,
        row: int,
        owner: Any,
        layers: list[tuple[torch.Tensor, torch.Tensor]],
        first_token: int,
        sampling: tuple[float, float, int] = (0.0, 1.0, 0),
    ) -> None:
        """Give `row` to `owner`: its prompt's keys and values (per layer [1, kv_heads, length, head_dim], from its
        prefill) at the columns just before the write column, the mask over them, the token the next step reads,
        and its sampling (temperature, top_p, seed); its first token, index 0, was drawn at the prefill."""
        if self.cache is None:
            self._allocate(layers)
        length = layers[0][0].shape[2]
        if length >= self.columns:
            raise ValueError(f"a prompt of {length} tokens does not fit {self.columns} cache columns")
        columns = (torch.arange(-length, 0, device=self.device) + self.write_column) % self.columns
        for layer, (keys, values) in zip(self.cache.layers, layers, strict=True):
            layer.keys[row].index_copy_(1, columns, keys[0])
            layer.values[row].index_copy_(1, columns, values[0])
        self.mask[row].zero_()
        self.mask[row, 0, 0, columns] = True
        self.position_ids[row, 0] = length
        self.input_ids[row, 0] = first_token
        temperature, top_p, seed = sampling
        self.temperature[row], self.top_p[row] = temperature, top_p
        if temperature != 0:
            indices = torch.arange(self.columns, device=self.device)
            self.uniforms[row] = uniforms(torch.full_like(indices, seed), indices)
        self.counter[row] = 1
        self.busy[row] = True
        self.owners[row] = owner

    def release(self, row: int) -> None:
        """Free `row`; its mask is cleared at the next step."""
        self.owners[row] = None
        self.busy[row] = False
        self.position_ids[row, 0] = 0

    def draws(self) -> torch.Tensor:
        """Each row's uniform for its next token ([slots], float64); advances the rows' token indices. A free row's
        index may run past the columns: it reads column 0 (its token is unused)."""
        u = self.uniforms.gather(1, (self.counter % self.columns)[:, None])[:, 0]
        self.counter.add_(1)
        return u

    def step(self) -> torch.Tensor:
        """One decoding step of every row: the logits of each row's next token, [slots, vocab] (valid until the next
        step; rows not busy hold garbage)."""
        # Free rows attend to the current column alone (see the module docstring); busy rows keep their columns.
        self.mask.logical_and_(self.busy.view(-1, 1, 1, 1))
        self.mask[:, 0, 0, self.write_column] = True
        self.column.fill_(self.write_column)
        if self._cuda_graphs:
            # Each replay may reuse the previous step's output memory: the caller reads the logits before the next.
            torch.compiler.cudagraph_mark_step_begin()
        logits = self._step()
        self.position_ids.add_(self.busy.view(-1, 1))
        self.write_column = (self.write_column + 1) % self.columns
        return logits
