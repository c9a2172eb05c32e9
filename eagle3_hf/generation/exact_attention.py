"""Row-exact tree verification: every tree node's attention computed as the target's own one-token step computes it.

Why. A verify forward over T tree nodes differs from T one-token decoding steps only in its attention calls: the
projections, norms, MLP and head give bitwise-equal rows for 1 or T input rows, but torch's CPU attention kernels
reduce over the keys in chunks whose layout depends on the key count (a vectorised exp-sum over whole 16-lane
chunks and a scalar tail, blocks of 512 keys), and a node's keys sit elsewhere in a tree-masked call than in its
own step. In bf16 the difference (~1e-3 per layer) grows to near-ties that change greedy output.

How. The target's attention implementation is swapped, for one decoding call, for `exact_attention_forward`
(registered in transformers' `AttentionInterface`; nothing is patched). For a tree forward it calls the attention
kernel once per tree depth (or per group of depths, see `ExactAttention.calls`), with the nodes along the batch
dimension, each node a single query over exactly the keys its own decoding step would see -- the prefix followed by
its ancestors and itself, at the positions that step has them, with the mask that step would get -- so each node's
call has the shape of a decoding step. Every other forward (prefill, root-only steps) goes to the original
implementation unchanged.

The keys are laid out without copying the prefix per node: per target layer the state keeps up to `max_rows` copies
of the prefix (appended to as tokens are accepted), and a tree forward only writes each node's ancestor path behind
the prefix in its row. Memory: up to `max_rows` extra copies of the target's KV cache.

Exactness holds for torch's CPU `sdpa` and eager attention (`probe.py` checks it for a given target, dtype and
thread count); other implementations are left as they are, and decoding works with near-tie differences.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from eagle3_hf.generation.transfers import upload
from eagle3_hf.generation.tree import node_paths

__all__ = ["ExactAttention", "exact_attention_forward", "exact_verification"]

# Original implementations whose one-query calls this module can reproduce.
SUPPORTED = ("sdpa", "eager")
# Registered as "eagle3_exact_sdpa" / "eagle3_exact_eager": the name also chooses the masks transformers builds
# (the original's), which the prefill and the model's other calls go on using.
PREFIX = "eagle3_exact_"


@dataclass(frozen=True)
class _Call:
    """One attention call of a tree forward: the depth-sorted nodes `start:stop`, keys `begin:end`, and, when its nodes
    see different numbers of those keys, `mask` (`[n, 1, 1, end - begin]` bool, True: visible; built once per tree
    rather than once per layer) hiding each node's trailing keys."""

    start: int
    stop: int
    begin: int
    end: int
    mask: torch.Tensor | None = field(default=None, compare=False)


@dataclass
class _LayerKeys:
    """One layer's prefix copies: keys/values `[rows, kv_heads, capacity, head_dim]`, the first `synced` filled."""

    keys: torch.Tensor
    values: torch.Tensor
    synced: int = 0


@dataclass
class ExactAttention:
    """Per-call state of row-exact verification (one decoding call, batch size 1).

    `set_tree(parents, past)` before a tree forward, `clear_tree()` after; the forward passes this object as the
    `eagle3_exact` keyword, which transformers hands on to every attention call. `max_rows` bounds the prefix copies
    kept per layer (and so the memory: `max_rows` copies of the target's KV cache); a call over more nodes is split.
    """

    implementation: str  # the target's own attention implementation ("sdpa" or "eager")
    max_rows: int = 16
    past: int = 0
    order: torch.Tensor | None = None  # [T] node indices sorted by depth; None: no tree planned
    depths: list[int] = field(default_factory=list)  # of the sorted nodes
    paths: torch.Tensor | None = None  # [T, max_depth + 1] each sorted node's path, padded by repeating the node
    sorted: bool = True  # the nodes are in depth order already (drafted trees are): no reordering needed
    key_index: torch.Tensor | None = None  # [T * (max_depth + 1)] `past + paths`, flat: cache positions to gather
    layers: dict[int, _LayerKeys] = field(default_factory=dict)
    _calls: dict[Any, list[_Call]] = field(default_factory=dict)

    def set_tree(self, parents: torch.Tensor, past: int) -> None:
        """Plan the next forward: the tree of `parents` `[T]` (`parents[i] < i`, root -1) behind `past` tokens."""
        paths = node_paths(parents.tolist())
        order = sorted(range(len(paths)), key=lambda i: len(paths[i]))
        width = max(len(p) for p in paths)
        device = parents.device
        self.sorted = order == list(range(len(order)))
        self.order, self.paths = upload(device, order, [paths[i] + [i] * (width - len(paths[i])) for i in order])
        self.depths = [len(paths[i]) - 1 for i in order]
        self.key_index = (past + self.paths).flatten()
        self.past = past
        self._calls = {}

    def clear_tree(self) -> None:
        self.order = self.paths = self.key_index = None

    def calls(self, window: int | None, merge: bool) -> list[_Call]:
        """The attention calls for a layer with sliding `window` (None: full attention).

        A node at depth d sees keys `[0, past + d + 1)` (the last `window` of them in a sliding layer). Nodes of one
        depth share one call. With `merge`, nodes of several depths share one, their shorter rows padded with masked
        trailing keys, where that provably leaves every row's result as its own step computes it: torch's CPU kernel
        sums a row's softmax in 16-lane chunks plus a scalar tail, so trailing masked keys (exp = 0) change nothing
        while the padded length stays in the row's own 16-key bin -- and no window moves the row's first key. That
        holds for AVX-512 kernels; elsewhere nothing is merged (`_merge_bin`).
        """
        key = (window, merge)
        if key not in self._calls:
            self._calls[key] = _plan_calls(self.depths, self.past, window, merge, self.max_rows, self.paths.device)
        return self._calls[key]

    def layer_keys(self, layer: int, key: torch.Tensor, value: torch.Tensor, needed: int) -> _LayerKeys:
        """Layer `layer`'s prefix copies, grown to hold `needed` positions and synced with `key` / `value`
        (`[1, kv_heads, past + T, head_dim]`, the cache with the tree appended) up to `past`."""
        rows, past = min(self.max_rows, len(self.depths)), self.past
        state = self.layers.get(layer)
        if state is None or state.keys.shape[0] < rows or state.keys.shape[2] < needed:
            rows = max(rows, state.keys.shape[0] if state is not None else 0)
            capacity = max(needed + 256, int(1.5 * (state.keys.shape[2] if state is not None else 0)))
            shape = (rows, key.shape[1], capacity, key.shape[3])
            # empty: filled below from the cache, which holds the prefix the old copies held
            state = self.layers[layer] = _LayerKeys(key.new_empty(shape), value.new_empty(shape))
        if state.synced > past:  # the cache was cropped (a stopping criterion cut a cycle short)
            state.synced = past
        if state.synced < past:
            state.keys[:, :, state.synced : past] = key[:, :, state.synced : past]
            state.values[:, :, state.synced : past] = value[:, :, state.synced : past]
            state.synced = past
        return state


@functools.cache
def _merge_bin() -> int | None:
    """The key-count bin within which trailing masked keys leave a row's attention bit for bit unchanged, or None
    where rows of different lengths must not share a call.

    16 where torch's CPU kernels vectorise with AVX-512 (checked bit for bit there by tests/test_exact_attention.py).
    On an AVX2-only CPU no bin was found safe: padding a row from 510 to 511 keys changed its result (8-key bins
    broke, 4-key bins held on the cases tried), so there every depth gets its own call."""
    return 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else None


def _plan_calls(
    depths: list[int], past: int, window: int | None, merge: bool, max_rows: int, device: torch.device
) -> list[_Call]:
    """See `ExactAttention.calls`; `depths` sorted."""
    bin_size = _merge_bin()
    merge = merge and bin_size is not None

    def span(depth: int) -> tuple[int, int]:
        end = past + depth + 1
        return (end - window if window is not None and end >= window else 0), end

    calls: list[_Call] = []
    start = 0
    while start < len(depths):
        begin, end = span(depths[start])
        stop = start + 1
        while stop < len(depths) and stop - start < max_rows:
            next_begin, next_end = span(depths[stop])
            same = next_end == end
            if not same and not (merge and next_begin == begin == 0 and next_end // bin_size == end // bin_size):
                break
            end = next_end
            stop += 1
        lengths = [span(d)[1] for d in depths[start:stop]]
        mask = None
        if len(set(lengths)) > 1:
            visible = torch.arange(begin, end, device=device)[None, :] < upload(device, lengths)[0][:, None]
            mask = visible[:, None, None, :]
        calls.append(_Call(start, stop, begin, end, mask))
        start = stop
    return calls


@contextmanager
def exact_verification(model: PreTrainedModel, enabled: bool = True) -> Iterator[ExactAttention | None]:
    """For the duration of one decoding call, route `model`'s attention through `exact_attention_forward`.

    Yields the call's `ExactAttention` state, or None when `enabled` is False or the model's implementation is not
    supported (decoding then runs as before). The model's own implementation is restored on exit.
    """
    implementation = getattr(model.config, "_attn_implementation", None)
    if not enabled or implementation not in SUPPORTED:
        yield None
        return
    name = PREFIX + implementation
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, exact_attention_forward)
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[implementation])
    model.set_attn_implementation(name)
    try:
        yield ExactAttention(implementation=implementation)
    finally:
        model.set_attn_implementation(implementation)


def _original(module: torch.nn.Module, implementation: str) -> Callable[..., tuple[torch.Tensor, Any]]:
    if implementation == "eager":
        # every transformers modeling file defines its own eager function (softcapping, sinks, ...)
        return sys.modules[type(module).__module__].eager_attention_forward
    return AttentionInterface._global_mapping[implementation]


def exact_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    eagle3_exact: ExactAttention | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """An attention function for transformers' `AttentionInterface` (see the module docstring).

    query `[1, heads, T, head_dim]`; key / value `[1, kv_heads, past + T, head_dim]` (the cache with the T new
    entries); returns `([1, T, heads, head_dim], None)` like transformers' own implementations.
    """
    state = eagle3_exact
    if state is None:
        raise ValueError(
            "this model's attention is set to row-exact verification, which needs the `eagle3_exact` state of an "
            "EAGLE-3 decoding call; call model.set_attn_implementation('sdpa') (or 'eager') to use it otherwise."
        )
    inner = _original(module, state.implementation)
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    past = state.past
    # The prefill, and one-token steps that see what a plain step sees (all full-attention keys, or a window not
    # yet filled), are plain steps already. A sliding-window step past its window is not: the target's plain cache
    # holds only the window, this call's cache everything, so it goes through the per-node path below.
    if state.order is None or (query.shape[2] == 1 and (window is None or past + 1 < window)):
        return inner(module, query, key, value, attention_mask, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"row-exact verification runs one sequence; got a batch of {query.shape[0]}")
    layer = state.layer_keys(module.layer_idx, key, value, past + state.depths[-1] + 1)
    queries = query[0].transpose(0, 1).unsqueeze(2)  # [T, heads, 1, head_dim]
    # depth-sorted, and contiguous as the kernels' one-token steps get them
    queries = queries.contiguous() if state.sorted else queries[state.order]
    direct = state.implementation == "sdpa" and not kwargs.get("softcap") and not kwargs.get("output_attentions")
    calls = state.calls(window, merge=direct)
    # each node's row: the prefix, then its path (root .. node) at the positions its own step has them. With a row
    # per node, every path is written in one gather; otherwise each call reuses the first rows.
    # (An index_select along the cache's key axis: advanced indexing of the transposed cache cost ~20x more.)
    nodes, width = state.paths.shape
    own_rows = layer.keys.shape[0] >= nodes
    if own_rows:
        for cache, rows_of in ((key, layer.keys), (value, layer.values)):
            gathered = cache[0].index_select(1, state.key_index).view(cache.shape[1], nodes, width, cache.shape[3])
            rows_of[:nodes, :, past : past + width] = gathered.transpose(0, 1)
    rows = []
    for call in calls:
        first = call.start if own_rows else 0
        last = first + call.stop - call.start
        if not own_rows:
            index = state.key_index.view(nodes, width)[call.start : call.stop, : call.end - past]
            for cache, rows_of in ((key, layer.keys), (value, layer.values)):
                gathered = cache[0].index_select(1, index.flatten()).view(cache.shape[1], last, -1, cache.shape[3])
                rows_of[:last, :, past : call.end] = gathered.transpose(0, 1)
        q = queries[call.start : call.stop]
        k, v = layer.keys[first:last, :, call.begin : call.end], layer.values[first:last, :, call.begin : call.end]
        if direct and call.begin == 0:
            rows.append(_decode_step_sdpa(module, q, k, v, call, kwargs))
            continue
        mask = None
        if call.begin > 0 and state.implementation == "sdpa":
            # a sliding-window step past its window: transformers passes an all-visible mask, and sdpa then packs
            # the query heads per key head (pack_gqa); calling it as it is reproduces that path
            mask = torch.ones(1, 1, 1, call.end - call.begin, dtype=torch.bool, device=query.device)
        out, _ = inner(module, q, k, v, mask, **kwargs)  # [n, 1, heads, head_dim]
        rows.append(out)
    out = (rows[0] if len(rows) == 1 else torch.cat(rows))[:, 0]  # [T, heads, head_dim], depth-sorted
    if not state.sorted:
        result = torch.empty_like(out)
        result[state.order] = out
        out = result
    return out.unsqueeze(0), None


def _decode_step_sdpa(
    module: torch.nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    call: _Call,
    kwargs: dict,
) -> torch.Tensor:
    """`torch.nn.functional.scaled_dot_product_attention` called as transformers' sdpa calls it for a one-token step
    over full attention (no mask, key heads shared through `enable_gqa`), for `n` nodes at once; rows shorter than the
    call see their trailing keys masked (see `ExactAttention.calls`). Returns `[n, 1, heads, head_dim]`."""
    extra = {"enable_gqa": True} if getattr(module, "num_key_value_groups", 1) > 1 else {}
    out = torch.nn.functional.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=call.mask,
        dropout_p=kwargs.get("dropout", 0.0),
        scale=kwargs.get("scaling"),
        is_causal=False,
        **extra,
    )  # [n, heads, 1, head_dim]
    return out.transpose(1, 2)
