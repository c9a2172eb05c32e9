"""The target side of EAGLE-3 decoding: a KV cache whose columns are per-row positions or holes.

After the prefill, column `c` of row `b` holds the prompt token at `c` (or left padding). Each cycle the target
verifies every row's tree in one forward, which appends the `T` (padded) tree nodes of every row as new columns;
then `keep_paths` keeps, per row, its accepted path at the start of that block and marks the rest as holes. A hole
-- left padding, a rejected node, a dummy node of a shorter tree -- is masked out of every later attention, exactly
as generate() masks left padding, and positions are carried per column, so sliding windows see true distances.
`compact` moves each row's valid columns together, dropping the columns no row needs, when those pile up.

Shapes: A active rows, S cache columns, T tree nodes per row (the largest tree; shorter ones get dummy nodes that
attend only to themselves and whose outputs are ignored). One row never gets holes: its cache is the plain
`DynamicCache` of its tokens, which row-exact verification (exact_attention.py) and the returned cache rely on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from eagle3_hf.generation.transfers import upload
from eagle3_hf.generation.tree import DraftTree, tree_attention_mask

__all__ = [
    "PaddedTrees",
    "TargetColumns",
    "crop_cache",
    "editable_cache",
    "keep_paths",
    "pad_trees",
    "target_tree_mask",
    "verify_mask",
    "worth_compacting",
]

# Compact a cache when compaction would drop at least this many columns, and this fraction of the longest row's
# tokens (see `worth_compacting`).
COMPACT_RATIO = 0.25
COMPACT_MIN_COLUMNS = 16


def worth_compacting(columns: int, longest: int) -> bool:
    """Whether to compact a cache of `columns` columns whose longest row holds `longest` tokens (numbers the host
    knows: deciding reads nothing from the device): compaction can drop only the columns beyond the longest row (the
    rest are some row's tokens); it pays when there are many of them, next to what each forward attends to anyway."""
    removable = columns - longest
    return removable >= COMPACT_MIN_COLUMNS and removable > COMPACT_RATIO * longest


def editable_cache(cache: Any) -> DynamicCache:
    """The target cache to decode into; refuse caches whose entries cannot be selected and cropped."""
    if cache is None:
        return DynamicCache()
    if not isinstance(cache, DynamicCache):
        raise ValueError(
            f"EAGLE-3 tree decoding edits the target KV cache (keeps only accepted tree nodes); a "
            f"{type(cache).__name__} cannot be edited that way. Use the default DynamicCache (no cache_implementation)."
        )
    if cache.get_seq_length() > 0:
        raise ValueError(
            f"EAGLE-3 decoding needs the target's hidden states for the whole prompt, so it prefills it itself; got a "
            f"cache already holding {cache.get_seq_length()} tokens. Pass no cache (or an empty DynamicCache)."
        )
    # A fresh cache: plain full-attention layers, which can drop rejected nodes; sliding-window layers are instead
    # masked by the tree mask.
    return DynamicCache()


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` columns of every layer (works across transformers 5.x releases)."""
    for layer in _layers(cache):
        layer.keys, layer.values = layer.keys[..., :length, :], layer.values[..., :length, :]


@dataclass
class TargetColumns:
    """What the shared target cache's columns mean, per active row."""

    valid: torch.Tensor  # [A, S] bool: a real token of that row (not padding, not a hole)
    positions: torch.Tensor  # [A, S] long: that token's position (anything for a hole)
    next_position: torch.Tensor  # [A] long: tokens of the row in the cache = the position of its root

    @classmethod
    def from_prompt(cls, attention_mask: torch.Tensor) -> TargetColumns:
        valid = attention_mask.bool()
        positions = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)
        return cls(valid=valid, positions=positions, next_position=valid.sum(dim=1))

    def crop(self, cache: DynamicCache, length: int) -> None:
        """Keep the first `length` columns (a stopping criterion cut one row's last cycle short)."""
        crop_cache(cache, length)
        self.valid, self.positions = self.valid[:, :length], self.positions[:, :length]
        self.next_position = self.valid.sum(dim=1)

    def select_rows(self, cache: DynamicCache, rows: torch.Tensor) -> None:
        for layer in _layers(cache):
            layer.keys, layer.values = layer.keys[rows], layer.values[rows]
        self.valid, self.positions = self.valid[rows], self.positions[rows]
        self.next_position = self.next_position[rows]

    def compact(self, cache: DynamicCache, keep: int) -> None:
        """Per row, its valid columns in order, right-aligned after the fewest holes any row needs (`keep` columns: the
        most tokens a row has, which the caller knows without reading `valid`)."""
        order = torch.sort(self.valid.to(torch.int8), dim=1, stable=True).indices[:, self.valid.shape[1] - keep :]
        for layer in _layers(cache):
            index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)
        self.valid, self.positions = self.valid.gather(1, order), self.positions.gather(1, order)


@dataclass
class PaddedTrees:
    """Every active row's tree, padded to T nodes."""

    tokens: torch.Tensor  # [A, T]
    positions: torch.Tensor  # [A, T] root position + depth (dummy nodes: the root's)
    mask: torch.Tensor  # [A, T, T] bool: a node sees itself and its ancestors; a dummy node only itself


def pad_trees(trees: list[DraftTree], next_position: torch.Tensor) -> PaddedTrees:
    width = max(tree.num_nodes for tree in trees)
    rows = len(trees)
    device = next_position.device
    tokens = torch.zeros(rows, width, dtype=torch.long, device=device)
    mask = torch.eye(width, dtype=torch.bool, device=device).repeat(rows, 1, 1)
    for row, tree in enumerate(trees):
        n = tree.num_nodes
        tokens[row, :n] = tree.tokens
        if n > 1:
            mask[row, :n, :n] = tree_attention_mask(tree.parents, check=False)  # the loop's own trees
    depths = mask.sum(dim=2) - 1  # [A, T]: a node's ancestors; a dummy node sees itself alone (the root's position)
    return PaddedTrees(tokens=tokens, positions=next_position[:, None] + depths, mask=mask)


def verify_mask(columns: TargetColumns, trees: PaddedTrees, dtype: torch.dtype, config: Any) -> Any:
    """Additive 4D mask `[A, 1, T, S + T]` for the verify forward (a per-layer-type dict for targets that mix
    sliding-window and full layers)."""
    text = config.get_text_config()
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    if window and layer_types and "sliding_attention" in layer_types:
        sliding = _mask(columns, trees, dtype, window)
        return {"full_attention": _mask(columns, trees, dtype), "sliding_attention": sliding}
    if window and not layer_types and getattr(text, "use_sliding_window", True):
        return _mask(columns, trees, dtype, window)
    return _mask(columns, trees, dtype)


def target_tree_mask(config: Any, tree_mask: torch.Tensor, past: int, dtype: torch.dtype) -> Any:
    """`verify_mask` for one tree (`tree_mask` `[T, T]` bool: a node sees itself and its ancestors) behind `past`
    cached tokens of one row without holes, nodes at `past + depth`: `[1, 1, T, past + T]`, or per layer type."""
    columns = TargetColumns.from_prompt(torch.ones(1, past, dtype=torch.long, device=tree_mask.device))
    positions = past + tree_mask.sum(dim=-1)[None] - 1
    trees = PaddedTrees(tokens=torch.zeros_like(positions), positions=positions, mask=tree_mask[None])
    return verify_mask(columns, trees, dtype, config)


def _mask(columns: TargetColumns, trees: PaddedTrees, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    rows, width = trees.tokens.shape
    visible = torch.cat([columns.valid[:, None, :].expand(rows, width, -1), trees.mask], dim=2)  # [A, T, S + T]
    if window is not None:
        keys = torch.cat([columns.positions, trees.positions], dim=1)  # [A, S + T]
        visible = visible & (trees.positions[:, :, None] - keys[:, None, :] < window)
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[:, None]


def keep_paths(
    cache: DynamicCache,
    columns: TargetColumns,
    start: int,
    paths: list[list[int]],
    index: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """After a verify forward appended T columns at `start`: keep each row's accepted `paths[row]` (node indices, root
    first) at the start of a block of `max(len(path))` columns, the rest of the block holes; drop the other columns.

    Returns the gather index `[A, W]` (node per kept column; 0 for a hole) and the kept columns `[A, W]` bool, and
    updates `columns`; the caller reuses them for the accepted nodes' features. Entries in place are not moved.
    `index` and `lengths` (`[A]`): the same on the device where the caller uploaded them with the cycle's other
    lists (engine.stage); else they are uploaded here."""
    width = max(len(path) for path in paths)
    device = columns.valid.device
    if index is None or lengths is None:
        index, lengths = upload(device, [path + [0] * (width - len(path)) for path in paths], [len(p) for p in paths])
    keep = torch.arange(width, device=device)[None] < lengths[:, None]  # [A, W]
    moved = any(path != list(range(len(path))) for path in paths)  # else every path is in place already
    for layer in _layers(cache):
        for name in ("keys", "values"):
            tensor = getattr(layer, name)
            if moved:
                gather = index[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
                tensor[:, :, start : start + width] = tensor[:, :, start:].gather(2, gather)
            setattr(layer, name, tensor[:, :, : start + width])
    steps = torch.arange(width, device=device)
    columns.valid = torch.cat([columns.valid, keep], dim=1)
    columns.positions = torch.cat([columns.positions, columns.next_position[:, None] + steps[None]], dim=1)
    columns.next_position = columns.next_position + keep.sum(dim=1)
    return index, keep


def _layers(cache: DynamicCache) -> list[Any]:
    return [layer for layer in cache.layers if getattr(layer, "keys", None) is not None and layer.keys.numel() > 0]
