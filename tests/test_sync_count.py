"""Host<->device transfers per decoding cycle: on an accelerator each read of a tensor's value on the host
(`.item()`, `.tolist()`, `int(t)`, `bool(t)`, `.cpu()`, ...) waits for every queued kernel, and so does a copy of a
Python list to the device from pageable memory. A cycle must make a bounded number of them, independent of how many
rows the batch has and how large and deep its trees are.

The loop moves data only through `eagle3_hf/generation/transfers.py` (`upload`, `read`). The CPU test counts, during
each decoding cycle:
- every read of a tensor's value on the host (patched `Tensor.item`, `tolist`, `__bool__`, ...), wherever it is made;
- the uploads (`transfers.COUNT.uploads`);
- stray transfers: any `torch.tensor` / `torch.as_tensor` / `torch.asarray` given a device, and any `Tensor.to` /
  `Tensor.cuda` given one, called from the generation package's own code outside transfers.py (on a CPU these cost
  nothing, on CUDA each would be a blocking copy): there must be none.
It runs the engine as it runs on an accelerator: `node_scores.READS_ARE_FREE` is patched to say reads cost a
synchronisation (on a CPU they do not, so there the target's greedy choice is read per visited node, which is cheaper
than one argmax over every node, and the draft's levels are decided one by one).

What a cycle reads: one copy of every row's tree (tokens, parents, scores) packed with the target's greedy choice
at every node (engine.accept; trees the proposer built from lists are not read again); one of the new tokens'
stopping flags (emission.emit); with the lookup (the hybrid tree) one of the draft's trees before the lookup is
grafted in; with the cost model sizing trees (`adaptive_tree`) one of the draft's best next tokens (whether to draft)
and the trees read before sizing them (the draft's levels are then decided with that one read, not one per level).
What it uploads: the trees built on the host, every row's in one copy (engine.propose); the accepted paths, new
tokens, their places in the output and the next roots in one copy (engine.stage); when rows finish, which go on.
The cost model's clocks are CUDA events read after those reads (transfers.Clock): no wait of their own.

On CUDA the same decoding runs under `torch.cuda.set_sync_debug_mode("error")` from its second cycle on: any
synchronisation but transfers.read's raises.
"""

import sys

import pytest
import torch
from helpers.generation import make_pair, make_prompts, plain

from eagle3_hf.generation import engine, node_scores, transfers
from eagle3_hf.generation.corpus_index import CorpusIndex

# The most of each a cycle may make, whatever the rows (1, 4, 8), nodes (30, 60) and depth (3, 6).
BOUND = {"reads": {False: 3, True: 4}, "uploads": 3}  # reads by `adaptive_tree`
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero", "__contains__")
MADE = ("tensor", "as_tensor", "asarray")  # tensors made from host data
MOVED = ("to", "cuda")


def _ours(depth: int = 2) -> bool:
    """Whether the call being counted comes from the generation package's code, outside transfers.py."""
    name = sys._getframe(depth).f_globals.get("__name__", "")
    return name.startswith("eagle3_hf.generation.") and name != transfers.__name__


def _names_a_device(args, kwargs) -> bool:
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (torch.device, str)) or (isinstance(a, torch.Tensor)) for a in args)


class TransferCounter:
    """Counts host reads of tensor values (a read nested in another, e.g. `tolist` inside `bool`, counts once),
    uploads, and stray transfers, while `active`."""

    def __init__(self, monkeypatch):
        self.reads = self.strays = 0
        self.active, self._depth, self._uploads = False, 0, 0
        self.where: list[str] = []
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._read(getattr(torch.Tensor, name)))
        for name in MADE:
            monkeypatch.setattr(torch, name, self._stray(getattr(torch, name), skip=0))
        for name in MOVED:
            monkeypatch.setattr(torch.Tensor, name, self._stray(getattr(torch.Tensor, name), skip=1))

    def start(self):
        self.reads = self.strays = 0
        self._uploads = transfers.COUNT.uploads
        self.active = True

    def stop(self) -> dict[str, int]:
        self.active = False
        return {"reads": self.reads, "uploads": transfers.COUNT.uploads - self._uploads, "strays": self.strays}

    def _read(self, method):
        def counted(tensor, *args, **kwargs):
            if self.active and self._depth == 0 and not tensor.is_meta:
                self.reads += 1
            self._depth += 1
            try:
                return method(tensor, *args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def _stray(self, function, skip):
        def counted(*args, **kwargs):
            if self.active and _ours() and _names_a_device(args[skip:], kwargs):
                self.strays += 1
                self.where.append(f"{function.__name__} from {sys._getframe(1).f_code.co_name}")
            return function(*args, **kwargs)

        return counted


def left_padded(prompts, device):
    """The prompts as one left-padded batch on `device`: ids and attention mask."""
    width = max(p.shape[1] for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.shape[1] :], mask[row, width - prompt.shape[1] :] = prompt[0], 1
    return ids.to(device), mask.to(device)


def transfers_per_cycle(monkeypatch, rows, nodes, sources, depth=6, adaptive=False, device="cpu"):
    """Each cycle's counts after the first (the first one's include the prefill's tail), and the tokens the corpus
    proposed that were accepted."""
    monkeypatch.setattr(node_scores, "READS_ARE_FREE", False)  # what a CUDA device decides by itself
    target, draft = make_pair("llama")
    prompts = make_prompts(lengths=(5, 9, 12, 7, 6, 10, 8, 11)[:rows], seed=3)
    corpus = False
    if sources == "corpus":  # the target's own answers to these prompts: the corpus proposes, and is right
        corpus = CorpusIndex.build(
            [plain(target, p, max_new_tokens=40)[0, p.shape[1] :] for p in prompts], vocab_size=target.config.vocab_size
        )
    target.to(device), draft.to(device)
    ids, mask = left_padded(prompts, device)
    counter = TransferCounter(monkeypatch)
    per_cycle = []

    def observe(record):  # called after each cycle's bookkeeping; the next cycle starts right after
        per_cycle.append(counter.stop())
        if not adaptive:  # every row verified a full tree
            assert all(size == nodes for size in record.tree_sizes), record.tree_sizes
        counter.start()

    out = target.generate(
        ids,
        attention_mask=mask,
        assistant_model=draft,
        do_sample=False,
        max_new_tokens=40,
        tree_depth=depth,
        tree_top_k=8,
        tree_total_tokens=nodes,
        adaptive_tree=adaptive,
        exact_verify=False,
        context_lookup=sources != "draft",
        corpus=corpus,
        return_dict_in_generate=True,
        eagle3_observer=observe,
    )
    counter.active = False
    assert not counter.where, counter.where  # no transfer outside transfers.py
    return per_cycle[1:], out.accepted_from_corpus + out.accepted_from_both


def check_bounded(runs, adaptive):
    for counts in runs.values():
        assert len(counts) >= 3, runs  # several full cycles were counted
        assert all(c["strays"] == 0 for c in counts), counts
        assert max(c["reads"] for c in counts) <= BOUND["reads"][adaptive], runs
        assert max(c["uploads"] for c in counts) <= BOUND["uploads"], runs


@pytest.mark.parametrize("sources", ["draft", "hybrid", "corpus"])
@pytest.mark.parametrize("rows", [1, 4, 8])
def test_a_cycle_transfers_a_bounded_number_of_times(monkeypatch, rows, sources, device):
    runs = {}
    for nodes, depth in ((30, 6), (60, 6), (30, 3)):
        counts, from_corpus = transfers_per_cycle(monkeypatch, rows, nodes, sources, depth, device=device)
        if sources == "corpus":  # the corpus took part, or its transfers were not counted
            assert from_corpus > 0
        runs[nodes, depth] = counts
    check_bounded(runs, adaptive=False)
    # the tree's size and depth do not matter: the most a cycle reads is the same
    assert len({max(c["reads"] for c in counts) for counts in runs.values()}) == 1, runs


@pytest.mark.parametrize("sources", ["draft", "hybrid"])
def test_the_cost_model_adds_a_bounded_number_of_reads(monkeypatch, sources):
    runs = {rows: transfers_per_cycle(monkeypatch, rows, 60, sources, adaptive=True)[0] for rows in (1, 8)}
    check_bounded(runs, adaptive=True)


def test_a_stray_transfer_is_counted(monkeypatch):
    """The counter sees uploads per row that bypass transfers.py in the generation package's code, and not the same
    call from elsewhere (so a clean count means something)."""
    counter = TransferCounter(monkeypatch)
    source = "def per_row(rows, device):\n    return [torch.tensor([r], device=device) for r in rows]"
    for module, expected in (("eagle3_hf.generation.somewhere", 4), ("transformers.somewhere", 0)):
        namespace = {"__name__": module, "torch": torch}
        exec(source, namespace)
        counter.start()
        namespace["per_row"](range(4), "cpu")
        assert counter.stop()["strays"] == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh runs it there)")
@pytest.mark.parametrize("sources", ["draft", "hybrid"])
@pytest.mark.parametrize("rows", [1, 4])
def test_a_cycle_never_synchronises_outside_its_reads_on_cuda(monkeypatch, rows, sources):
    """From the second cycle on, any synchronisation but transfers.read's raises (sync debug mode "error")."""
    real_retire = engine.retire_rows
    cycles = []

    def observe(record):  # the first cycle includes the prefill's tail: guard from the second on
        cycles.append(record)
        torch.cuda.set_sync_debug_mode("error")

    def retire(run):
        real_retire(run)
        if not run.active:  # after the last cycle: the call's own wrap-up may read what it likes
            torch.cuda.set_sync_debug_mode(0)

    monkeypatch.setattr(engine, "retire_rows", retire)
    target, draft = make_pair("llama")
    target.to("cuda"), draft.to("cuda")
    ids, mask = left_padded(make_prompts(lengths=(5, 9, 12, 7)[:rows], seed=3), "cuda")
    try:
        out = target.generate(
            ids,
            attention_mask=mask,
            assistant_model=draft,
            do_sample=False,
            max_new_tokens=40,
            tree_depth=6,
            tree_top_k=8,
            tree_total_tokens=30,
            context_lookup=sources != "draft",
            eagle3_observer=observe,
        )
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(cycles) >= 3 and out.shape[0] == rows
