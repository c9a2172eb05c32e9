"""Host reads per decoding cycle: on an accelerator each read of a tensor's value on the host (`.item()`, `.tolist()`,
`int(t)`, `bool(t)`, `.cpu()`, ...) waits for every queued kernel, so a cycle must make a bounded number of them,
independent of how many nodes its trees have and how many rows the batch has.

The test counts every such read on a real (non-meta) tensor during the decoding loop's cycles of a depth-6 tree of 30
nodes, then 60, at batch 1 and batch 4 (greedy, fp32 tiny random target and draft, the draft's tree alone, the
hybrid tree, and the hybrid tree with a corpus as a third source), and fails above `BOUND`. It runs the engine as it
runs on an accelerator: `node_scores.READS_ARE_FREE` is patched to say reads cost a synchronisation (on a CPU they do
not, so there the target's greedy choice is read per visited node, which is cheaper than one argmax over every node).

What a cycle still reads, whatever the rows and nodes: one `.tolist()` of every row's tree (tokens, parents, scores)
packed together with the target's greedy choice at every node (engine.accept; trees the proposer built from lists,
the lookup's and the hybrid's, are not read again); one of the new tokens' stopping flags, every row's together
(emission.emit); with the lookup (the hybrid tree), one read of the draft's trees before the lookup is grafted into
them (proposers.HybridProposer). The corpus adds none: it is queried with the host's copy of each row's tokens, its
index lives in host (numpy) memory, and its nodes' matches travel with the tree's host lists. Where the cost model
sizes trees (`adaptive_tree`, not counted here) it adds its reads per cycle and one per draft level. Nothing is read
per row or per node. Not counted: on CUDA the loop also waits twice per cycle (`torch.cuda.synchronize` in
engine.py's `propose` and `update`) for the cost model's clocks.
"""

import pytest
import torch
from helpers.generation import make_pair, make_prompts, plain

from eagle3_hf.generation import node_scores
from eagle3_hf.generation.corpus_index import CorpusIndex

# Per batch size: the most host reads one cycle may make (the same for 30 and 60 nodes; 1 and 4 rows alike).
BOUND = {1: 3, 4: 3}
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero", "__contains__")


class ReadCounter:
    """Counts host reads of tensor values while `active`; a read nested in another (e.g. `tolist` inside `bool`)
    counts once."""

    def __init__(self, monkeypatch):
        self.count, self.active, self._depth = 0, False, 0
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(getattr(torch.Tensor, name)))

    def _wrap(self, method):
        def counted(tensor, *args, **kwargs):
            if self.active and self._depth == 0 and not tensor.is_meta:
                self.count += 1
            self._depth += 1
            try:
                return method(tensor, *args, **kwargs)
            finally:
                self._depth -= 1

        return counted


def reads_per_cycle(monkeypatch, rows, nodes, sources, device="cpu"):
    """The host reads of each cycle after the first (the first one's count includes the prefill's tail), and the
    tokens the corpus proposed that were accepted."""
    monkeypatch.setattr(node_scores, "READS_ARE_FREE", False)  # what a CUDA device decides by itself
    target, draft = make_pair("llama")
    prompts = make_prompts(lengths=(5, 9, 12, 7)[:rows], seed=3)
    corpus = False
    if sources == "corpus":  # the target's own answers to these prompts: the corpus proposes, and is right
        corpus = CorpusIndex.build(
            [plain(target, p, max_new_tokens=40)[0, p.shape[1] :] for p in prompts], vocab_size=target.config.vocab_size
        )
    target.to(device), draft.to(device)
    width = max(p.shape[1] for p in prompts)
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.shape[1] :], mask[row, width - prompt.shape[1] :] = prompt[0], 1
    counter = ReadCounter(monkeypatch)
    per_cycle = []

    def observe(record):  # called after each cycle's bookkeeping; the next cycle starts right after
        counter.active = False
        assert all(size == nodes for size in record.tree_sizes), record.tree_sizes  # every row verified a full tree
        per_cycle.append(counter.count)
        counter.count, counter.active = 0, True

    out = target.generate(
        ids.to(device),
        attention_mask=mask.to(device),
        assistant_model=draft,
        do_sample=False,
        max_new_tokens=40,
        tree_depth=6,
        tree_top_k=8,
        tree_total_tokens=nodes,
        adaptive_tree=False,
        exact_verify=False,
        context_lookup=sources != "draft",
        corpus=corpus,
        return_dict_in_generate=True,
        eagle3_observer=observe,
    )
    counter.active = False
    return per_cycle[1:], out.accepted_from_corpus + out.accepted_from_both


@pytest.mark.parametrize("sources", ["draft", "hybrid", "corpus"])
@pytest.mark.parametrize("rows", [1, 4])
def test_a_cycle_reads_the_host_a_bounded_number_of_times(monkeypatch, rows, sources, device):
    runs = {nodes: reads_per_cycle(monkeypatch, rows, nodes, sources, device) for nodes in (30, 60)}
    counts = {nodes: run[0] for nodes, run in runs.items()}
    assert all(len(c) >= 3 for c in counts.values())  # several full cycles were counted
    if sources == "corpus":  # the corpus took part, or its reads were not counted
        assert all(run[1] > 0 for run in runs.values()), runs
    assert max(counts[30]) <= BOUND[rows] and max(counts[60]) <= BOUND[rows], counts
    assert max(counts[30]) == max(counts[60]), counts  # the tree's size does not matter
