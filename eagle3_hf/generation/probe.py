"""The row-invariance probe: does a tree verify forward compute, bit for bit, what one-token steps compute?

For a target (in its dtype, at the current thread count) and a tree, `probe_row_exactness` runs the tree forward the
way EAGLE-3 decoding verifies (row-exact or one tree-masked call), and for every node the target's own one-token
decoding steps along the node's path, from copies of the same cache. Forward hooks record every submodule's output
in both, so when the logits differ it names the first op whose output differs for some node, in execution order --
the attention call itself when a layer's q/k/v projections agree and its `o_proj` input does not.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache

from eagle3_hf.generation.exact_attention import exact_verification
from eagle3_hf.generation.target_cache import target_tree_mask
from eagle3_hf.generation.tree import node_paths, tree_attention_mask
from eagle3_hf.utils.compat import cache_kwargs

__all__ = ["DEFAULT_PROBE_TREE", "ProbeResult", "probe_row_exactness"]

# 16 nodes, up to 4 wide and 5 deep: the shapes `bench`'s trees take
DEFAULT_PROBE_TREE = (-1, 0, 0, 0, 1, 1, 2, 4, 4, 5, 7, 7, 8, 10, 11, 13)


@dataclass(frozen=True)
class ProbeResult:
    """What the probe found.

    Attributes:
        identical: every node's logits equal its one-token steps' bit for bit.
        exact_verify: whether the tree forward ran row-exact (exact_attention.py) or as one tree-masked call.
        attn_implementation: the target's attention implementation.
        dtype: the target's dtype, e.g. "torch.bfloat16".
        threads: torch threads during the probe.
        nodes: tree nodes; prefix: tokens before the tree.
        max_logit_difference: the largest absolute logit difference over all nodes.
        first_difference: the first op (module name, "(attention)" for the attention call) whose output differs for
            some node, or None when all are equal.
    """

    identical: bool
    exact_verify: bool
    attn_implementation: str
    dtype: str
    threads: int
    nodes: int
    prefix: int
    max_logit_difference: float
    first_difference: str | None

    def describe(self) -> str:
        how = "row-exact" if self.exact_verify else "one tree-masked call"
        setting = f"{self.nodes}-node tree ({how}) after {self.prefix} tokens, {self.dtype}, {self.attn_implementation}"
        if self.identical:
            return f"verify forward == one-token steps bit for bit ({setting}, {self.threads} threads)"
        return (
            f"verify forward != one-token steps ({setting}, {self.threads} threads): logits up to "
            f"{self.max_logit_difference:.3g} apart, first at {self.first_difference}"
        )


class _Recorder:
    """Forward hooks on every submodule: each call's output `[1, rows, ...]` by module name, in call order; before an
    `o_proj`'s, its input (the attention call's result) as `LAYER.self_attn (attention)`."""

    def __init__(self, model: torch.nn.Module):
        self.outputs: dict[str, torch.Tensor] = {}
        self.order: list[str] = []
        self._handles = []
        for name, module in model.named_modules():
            if name:
                self._handles.append(module.register_forward_hook(self._hook(name)))

    def _record(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.outputs:
            self.order.append(name)
        self.outputs[name] = tensor.detach().clone()

    def _hook(self, name: str) -> Any:
        def record(module: torch.nn.Module, args: tuple, output: Any) -> None:
            out = output[0] if isinstance(output, tuple) else output
            if not torch.is_tensor(out) or out.dim() < 2:
                return
            if name.endswith("self_attn.o_proj") and args and torch.is_tensor(args[0]):
                self._record(name.removesuffix(".o_proj") + " (attention)", args[0])
            self._record(name, out)

        return record

    def clear(self) -> None:
        self.outputs, self.order = {}, []

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def _differs(tree: torch.Tensor, steps: list[torch.Tensor]) -> bool:
    """Whether some node's row of the tree forward's output differs from its one-token step's (rows along the axis
    that has one entry per node: `[1, T, ...]`, or `[1, heads, T, dim]` after a transpose)."""
    nodes = len(steps)
    axis = 1 if tree.shape[1] == nodes else 2 if tree.dim() > 2 and tree.shape[2] == nodes else None
    if axis is None:
        return False  # not a per-token output
    rows = zip(tree[0].unbind(axis - 1), steps)
    return any(not torch.equal(row, step[0].select(axis - 1, -1)) for row, step in rows)


def probe_row_exactness(
    target: PreTrainedModel,
    parents: tuple[int, ...] | list[int] = DEFAULT_PROBE_TREE,
    prefix: int = 48,
    exact_verify: bool = True,
    seed: int = 0,
) -> ProbeResult:
    """Compare a tree verify forward with one-token steps (see the module docstring); returns a `ProbeResult`.

    The prompt and the tree's tokens are random ids (`seed`); `parents[i] < i`, the root's parent -1.
    """
    parents = list(parents)
    if not parents or parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(parents) if i):
        raise ValueError(f"parents must start with -1 (the root) and have parents[i] in [0, i); got {parents}")
    if prefix < 1:
        raise ValueError(f"prefix must be >= 1 token, got {prefix}")
    device = target.device
    generator = torch.Generator().manual_seed(seed)
    vocab = target.config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (1, prefix), generator=generator).to(device)
    tokens = torch.randint(0, vocab, (len(parents),), generator=generator).to(device)
    paths = node_paths(parents)
    depths = torch.tensor([len(p) - 1 for p in paths], device=device)
    recorder = _Recorder(target)
    try:
        with torch.no_grad():
            # the reference: plain decoding's cache and one-token steps along each node's path
            cache = DynamicCache(config=target.config)
            target(prompt, use_cache=True, **cache_kwargs(cache))
            steps: list[dict[str, torch.Tensor]] = []
            step_logits = []
            for path in paths:
                step_cache = copy.deepcopy(cache)
                for node in path:
                    recorder.clear()
                    step = target(tokens[None, node : node + 1], use_cache=True, **cache_kwargs(step_cache))
                steps.append(dict(recorder.outputs))
                step_logits.append(step.logits[0, -1].float())
            # the verify forward, as decoding runs it
            with exact_verification(target, enabled=exact_verify) as state:
                tree_cache = DynamicCache()
                extra = {} if state is None else {"eagle3_exact": state}
                target(prompt, use_cache=True, **cache_kwargs(tree_cache), **extra)
                if state is not None:
                    state.set_tree(torch.tensor(parents, device=device), prefix)
                mask = target_tree_mask(
                    target.config, tree_attention_mask(torch.tensor(parents, device=device)), prefix, target.dtype
                )
                recorder.clear()
                out = target(
                    tokens[None],
                    use_cache=True,
                    position_ids=(prefix + depths)[None],
                    attention_mask=mask,
                    **cache_kwargs(tree_cache),
                    **extra,
                )
            tree_outputs, order = dict(recorder.outputs), list(recorder.order)
    finally:
        recorder.close()
    difference = float((out.logits[0].float() - torch.stack(step_logits)).abs().max())
    first = next((name for name in order if _differs(tree_outputs[name], [s[name] for s in steps])), None)
    return ProbeResult(
        identical=difference == 0.0 and first is None,
        exact_verify=exact_verify,
        attn_implementation=str(getattr(target.config, "_attn_implementation", None)),
        dtype=str(target.dtype),
        threads=torch.get_num_threads(),
        nodes=len(parents),
        prefix=prefix,
        max_logit_difference=difference,
        first_difference=first,
    )
