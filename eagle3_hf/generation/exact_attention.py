"""Row-exact tree verification: every tree node's attention computed as the target's own one-token step computes it.

Why. A verify forward over T tree nodes differs from T one-token decoding steps only in its attention calls: the
projections, norms, MLP and head give bitwise-equal rows for 1 or T input rows, but torch's CPU attention kernels
reduce over the keys in chunks whose layout depends on the key count (a vectorised exp-sum over whole 16-lane
chunks and a scalar tail, blocks of 512 keys), and a node's keys sit elsewhere in a tree-masked call than in its
own step. In bf16 the difference (~1e-3 per layer) grows to near-ties that change greedy output.

How. The target's attention implementation is swapped, for one decoding call, for `exact_attention_forward`
(registered in transformers' `AttentionInterface`; nothing is patched). For a tree forward it calls the target's
original implementation once per tree depth, with that depth's nodes along the batch dimension, each node a single
query over exactly the keys its own decoding step would see -- the prefix followed by its ancestors and itself, as
many keys as that step has, with the mask that step would get -- so each node's call has the shape of a decoding
step. Every other forward (prefill, root-only steps) goes to the original implementation unchanged.

The keys are laid out without copying the prefix per node: per target layer the state keeps `width` copies of the
prefix (appended to as tokens are accepted), and a tree forward only writes each node's ancestor path behind the
prefix in its row. Memory: `width` extra copies of the target's KV cache.

Exactness holds for torch's CPU `sdpa` and eager attention (`probe.py` checks it for a given target, dtype and
thread count); other implementations are left as they are, and decoding works with near-tie differences.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

__all__ = ["ExactAttention", "exact_attention_forward", "exact_verification", "supports_exact"]

# Original implementations whose one-query calls this module can reproduce.
SUPPORTED = ("sdpa", "eager")
# Registered as "eagle3_exact_sdpa" / "eagle3_exact_eager": the name also chooses the masks transformers builds
# (the original's), which the prefill and the model's other calls go on using.
PREFIX = "eagle3_exact_"


@dataclass
class _TreeGroup:
    """The nodes of one depth: their indices `[n]` and ancestor paths `[n, depth + 1]` (root first, node last)."""

    depth: int
    nodes: torch.Tensor
    paths: torch.Tensor


@dataclass
class _LayerKeys:
    """One layer's prefix copies: keys/values `[width, kv_heads, capacity, head_dim]`, the first `synced` filled."""

    keys: torch.Tensor
    values: torch.Tensor
    synced: int = 0


@dataclass
class ExactAttention:
    """Per-call state of row-exact verification (one decoding call, batch size 1).

    `set_tree(parents, past)` before a tree forward, `clear_tree()` after; the forward passes this object as the
    `eagle3_exact` keyword, which transformers hands on to every attention call.
    """

    implementation: str  # the target's own attention implementation ("sdpa" or "eager")
    groups: list[_TreeGroup] | None = None
    past: int = 0
    layers: dict[int, _LayerKeys] = field(default_factory=dict)

    def set_tree(self, parents: torch.Tensor, past: int) -> None:
        """Plan the next forward: the tree of `parents` `[T]` (`parents[i] < i`, root -1) behind `past` tokens."""
        parent_list = parents.tolist()
        paths: list[list[int]] = []
        for i, p in enumerate(parent_list):
            paths.append([i] if p < 0 else paths[p] + [i])
        by_depth: dict[int, list[int]] = {}
        for i, path in enumerate(paths):
            by_depth.setdefault(len(path) - 1, []).append(i)
        device = parents.device
        self.groups = [
            _TreeGroup(
                depth=d,
                nodes=torch.tensor(nodes, device=device),
                paths=torch.tensor([paths[i] for i in nodes], device=device),
            )
            for d, nodes in sorted(by_depth.items())
        ]
        self.past = past

    def clear_tree(self) -> None:
        self.groups = None

    @property
    def width(self) -> int:
        """Prefix copies a layer needs for the planned tree: its widest depth."""
        return max((g.nodes.numel() for g in self.groups or ()), default=1)

    def layer_keys(self, layer: int, key: torch.Tensor, value: torch.Tensor, needed: int) -> _LayerKeys:
        """Layer `layer`'s prefix copies, grown to `width` rows and `needed` positions and synced with `key` /
        `value` (`[1, kv_heads, past + T, head_dim]`, the cache with the tree appended) up to `past`."""
        width, past = self.width, self.past
        state = self.layers.get(layer)
        if state is None or state.keys.shape[0] < width or state.keys.shape[2] < needed:
            rows = max(width, state.keys.shape[0] if state is not None else 0)
            capacity = max(needed + 256, int(1.5 * (state.keys.shape[2] if state is not None else 0)))
            shape = (rows, key.shape[1], capacity, key.shape[3])
            grown = _LayerKeys(key.new_empty(shape), value.new_empty(shape))
            if state is not None and state.synced:
                n = min(state.synced, past)
                grown.keys[:, :, :n] = state.keys[:1, :, :n]  # every row holds the same prefix
                grown.values[:, :, :n] = state.values[:1, :, :n]
                grown.synced = n
            state = self.layers[layer] = grown
        if state.synced > past:  # the cache was cropped (a stopping criterion cut a cycle short)
            state.synced = past
        if state.synced < past:
            state.keys[:, :, state.synced : past] = key[:, :, state.synced : past]
            state.values[:, :, state.synced : past] = value[:, :, state.synced : past]
            state.synced = past
        return state


def supports_exact(model: PreTrainedModel) -> bool:
    """Whether `model`'s attention implementation is one whose decoding steps `exact_attention_forward` reproduces."""
    return getattr(model.config, "_attn_implementation", None) in SUPPORTED


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
    if state.groups is None or (query.shape[2] == 1 and (window is None or past + 1 < window)):
        return inner(module, query, key, value, attention_mask, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"row-exact verification runs one sequence; got a batch of {query.shape[0]}")
    deepest = state.groups[-1].depth
    layer = state.layer_keys(module.layer_idx, key, value, past + deepest + 1)
    tree_keys = key[0, :, past:].transpose(0, 1)  # [T, kv_heads, head_dim]
    tree_values = value[0, :, past:].transpose(0, 1)
    queries = query[0].transpose(0, 1).unsqueeze(2)  # [T, heads, 1, head_dim]
    out = query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])  # [1, T, heads, head_dim]
    for group in state.groups:
        n, end = group.nodes.numel(), past + group.depth + 1
        # each node's row: the prefix, then its path (root .. node) at the positions its own step has them
        layer.keys[:n, :, past:end] = tree_keys[group.paths].transpose(1, 2)
        layer.values[:n, :, past:end] = tree_values[group.paths].transpose(1, 2)
        begin, mask = 0, None
        if window is not None and end >= window:
            # a sliding-window step sees its last `window` keys, and transformers then passes an all-visible mask
            begin = end - window
            if state.implementation == "sdpa":
                mask = torch.ones(1, 1, 1, window, dtype=torch.bool, device=query.device)
        rows, _ = inner(
            module, queries[group.nodes], layer.keys[:n, :, begin:end], layer.values[:n, :, begin:end], mask, **kwargs
        )  # [n, 1, heads, head_dim]
        out[0, group.nodes] = rows[:, 0]
    return out, None
