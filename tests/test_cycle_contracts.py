"""The decoding loop's contracts (generation/cycle.py): a proposer is handed a read-only `CycleView` of the cycle,
never the loop's run, and the run's state is split between emission, the statistics and the loop."""

import dataclasses

import pytest
import torch
from helpers.generation import make_pair, make_prompts

from eagle3_hf.generation import proposers
from eagle3_hf.generation.cycle import CycleStats, CycleView, DecodeRun, Emission


def test_a_proposer_sees_only_a_read_only_view_of_the_cycle(monkeypatch):
    seen = []
    for cls, name in ((proposers.DraftProposer, "prefill"), (proposers.LookupProposer, "propose")):
        for method in (name, "observe"):
            real = getattr(cls, method)

            def spy(self, view, *args, _real=real, **kwargs):
                seen.append((view, view.rows, view.sequence(0)))  # a live view: read it during the call
                return _real(self, view, *args, **kwargs)

            monkeypatch.setattr(cls, method, spy)
    target, draft = make_pair("llama")
    prompt = make_prompts(lengths=(9,), seed=2)[0]
    target.generate(prompt, attention_mask=torch.ones_like(prompt), assistant_model=draft, max_new_tokens=12)
    assert len(seen) >= 3 and all(type(view) is CycleView for view, _, _ in seen)
    view, rows, sequence = seen[-1]
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.budget = None
    for name in ("cache", "proposer", "model", "out", "emission", "stats", "columns"):
        assert not hasattr(view, name), name  # nothing of the run but what a proposer reads
    assert rows == 1 and sequence[: prompt.shape[1]] == prompt[0].tolist() and len(sequence) > prompt.shape[1]


def test_the_run_state_is_split_by_owner():
    names = {cls: {f.name for f in dataclasses.fields(cls)} for cls in (DecodeRun, Emission, CycleStats)}
    assert {"out", "lengths", "tokens", "stop_lengths", "active", "scores"} <= names[Emission]
    assert {"accept_lengths", "tree_sizes", "accept_sources", "draft_time", "verify_time"} <= names[CycleStats]
    assert {"emission", "stats", "cache", "proposer", "cost"} <= names[DecodeRun]
    assert not (names[DecodeRun] & names[Emission]) and not (names[DecodeRun] & names[CycleStats])
