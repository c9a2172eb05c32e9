"""Statistical losslessness of EAGLE-3 sampling inside `target.generate(do_sample=True)`.

A tiny Llama target over 8 tokens (sharpened lm_head) and a random, deliberately poor draft. The exact law of the 2nd
and 3rd generated tokens (the first EAGLE-3 cycle: the 1st comes from the prefill) is computed by enumerating target
forwards through the same logits warpers generate() builds (temperature, then top-p). N sampled continuations are
compared with it by a chi-square test (cells with expected count < 5 pooled; alpha = 0.001), for a chain and a
sampled tree, at T=1 and at T=0.7 with top_p=0.9. Outcomes the exact law forbids (top-p) must never occur. The mixed
tree adds the context lookup (`context_lookup=True`) on a prompt holding every token twice: its continuations are
point-mass proposals beside the draft's samples in the same recursive rejection.
"""

import pytest
import torch
from helpers.sampling import (
    PROMPT,
    REPEATING,
    SETTINGS,
    TREES,
    N,
    check_law,
    chi_square,
    models,  # noqa: F401 (fixture)
)


def test_chi_square_pooling():
    counts = torch.tensor([10.0, 12.0, 3.0, 1.0, 0.0])
    expected = torch.tensor([11.0, 11.0, 2.0, 2.0, 0.0])  # the two small cells make one pool of 4 < 5: merged
    stat, dof = chi_square(counts, expected)
    assert dof == 1 and stat == pytest.approx((10 - 11) ** 2 / 11 + (16 - 15) ** 2 / 15)


@pytest.mark.grid
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("tree", list(reversed(TREES)))  # the tree first: the fast tier runs it
def test_sampled_tokens_follow_the_target_law(models, tree, setting):
    target, draft = models
    torch.manual_seed(1000 + 10 * list(TREES).index(tree) + list(SETTINGS).index(setting))
    check_law(target, draft, PROMPT, SETTINGS[setting], TREES[tree], f"{tree}/{setting}")


@pytest.mark.grid
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_mixed_lookup_and_draft_tree_follows_the_target_law(models, setting):
    target, draft = models
    torch.manual_seed(2000 + list(SETTINGS).index(setting))
    # lookup_confidence 1.0: the draft is always consulted, so every first cycle mixes both sources
    mixed = dict(TREES["tree"], context_lookup=True, lookup_confidence=1.0)
    outputs = check_law(target, draft, REPEATING, SETTINGS[setting], mixed, f"mixed/{setting}")
    assert sum(out.accept_sources[0][1] > 0 for out in outputs) > 0.05 * N, "the lookup's proposals were never accepted"
    assert sum(out.accept_sources[0][0] > 0 for out in outputs) > 0.05 * N, "the draft's proposals were never accepted"
