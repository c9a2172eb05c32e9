"""The target's scores at the nodes of a verified tree, computed only at the nodes acceptance and the output read.

A verify forward returns logits for every node `[T, V]` in the model's dtype. Acceptance reads the processed
scores of the nodes it visits -- the accepted path and the node after which the bonus token is chosen, at most the
tree's depth + 1 of its T nodes -- and the output keeps those of the path (`output_scores` / `output_logits`). So
instead of casting all T rows to fp32 and running the logits processors over all of them, each row is cast and
processed when first read, with that node's own root-to-node path as the processors' input_ids (as plain decoding
processes its one row at that point of the sequence). A greedy choice is then the argmax of that one fp32 row, the op
plain decoding runs: on this CPU an argmax over all T rows costs more than one over each visited row (an argmax over
[16, 49152] fp32 measured ~0.6 ms, over bf16 ~1.5 ms, over one fp32 row ~0.1 ms).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.generation import LogitsProcessorList

from eagle3_hf.generation.transfers import upload
from eagle3_hf.generation.tree import DraftTree

__all__ = ["NodeScores", "reads_are_free"]

# On a CPU reading a tensor's value on the host costs no synchronisation, so a greedy choice is read per visited node
# (cheaper there than one argmax over every node, above). On an accelerator every read waits for the queued kernels:
# the choices of every node of every row are then computed at once and read with the trees (engine.accept).
# None: decided by the device (tests set it to run the accelerator's way on a CPU).
READS_ARE_FREE: bool | None = None


def reads_are_free(device: torch.device) -> bool:
    return device.type == "cpu" if READS_ARE_FREE is None else READS_ARE_FREE


@dataclass
class NodeScores:
    """Per-cycle scores of one row's tree: `logits` `[T, V]` from the verify forward, `prefix` `[1, L]` the row's
    output so far (ending with the root's token), the call's logits processors.

    In a batch of `batch_size` rows, generate() builds some processors with per-row state (repetition penalty: each
    row's padding length), so each call gets the whole batch's shape, the row repeated, and keeps row `row`."""

    logits: torch.Tensor
    tree: DraftTree
    prefix: torch.Tensor
    processors: LogitsProcessorList
    row: int = 0
    batch_size: int = 1
    choices: list[int] | None = None  # the greedy choice at every node, when read with the tree (engine.accept)
    _processed: dict[int, torch.Tensor] = field(default_factory=dict)

    def processed(self, node: int) -> torch.Tensor:
        """Node `node`'s logits in fp32 after the processors, given its own path as input_ids, `[V]` (cached)."""
        if node not in self._processed:
            scores = self.logits[node].float()
            if len(self.processors) > 0:
                ids, rows = self.input_ids(node), self.batch_size
                scores = self.processors(ids.expand(rows, -1), scores[None].expand(rows, -1).clone())[self.row]
            self._processed[node] = scores
        return self._processed[node]

    def input_ids(self, node: int) -> torch.Tensor:
        """What plain decoding's input_ids are when it scores the token after `node`: the prefix, then the tokens of
        `node`'s path below the root, `[1, L + depth]`."""
        parents = self.tree.host.parents if self.tree.host is not None else self.tree.parents.tolist()
        path = []
        while node > 0:
            path.append(node)
            node = parents[node]
        if not path:
            return self.prefix
        tokens = self.tree.tokens[upload(self.tree.tokens.device, path[::-1])[0]]
        return torch.cat([self.prefix, tokens[None].to(self.prefix.dtype)], dim=1)

    def greedy_choice(self, node: int) -> int:
        """The target's greedy token after `node`."""
        return self.choices[node] if self.choices is not None else int(self.processed(node).argmax())

    def all_choices(self) -> torch.Tensor:
        """The target's greedy token after every node, `[T]`, on the device (nothing read): without processors one
        argmax over the raw rows (casting to fp32 changes no argmax), else each node processed on its own path."""
        if len(self.processors) == 0:
            return self.logits.argmax(dim=-1)
        return torch.stack([self.processed(node) for node in range(self.tree.num_nodes)]).argmax(dim=-1)

    def probs(self, node: int) -> torch.Tensor:
        """The target's sampling distribution after `node`, `[V]` (the processors include any temperature)."""
        return torch.softmax(self.processed(node), dim=-1)

    def path_rows(self, path: list[int], processed: bool, raw: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The accepted `path`'s processed scores and raw fp32 logits, `[n, V]` each (None where not asked for)."""
        processed_rows = torch.stack([self.processed(n) for n in path]) if processed else None
        raw_rows = self.logits[upload(self.logits.device, path)[0]].float() if raw else None
        return processed_rows, raw_rows
