"""EAGLE-3.1 and the other norm flags through every layout: each layout's loader reads `fc_norm`, `norm_output`,
`norm_before_fc`, `norm_before_residual`, `target_hidden_size`, `num_aux_hidden_states` and the tap ids the way vLLM
and SGLang read them, each exporter writes what its readers take for the same draft or refuses with the reason, and
a field a producer meant otherwise in an earlier version loads with a warning naming the value, or as the caller
chooses (`from_pretrained(..., norm_output=..., target_layer_ids=...)`).

The synthetic checkpoints and the independent reference forward are test_convert's.
"""

import contextlib
import itertools
import json
import warnings

import pytest
import torch
from helpers.convert import (  # noqa: F401  (target: the tiny target fixture)
    L,
    assert_same_draft,
    check_against_reference,
    draft_weights,
    external_config,
    randomized_draft,
    spec,
    target,
    write_checkpoint,
)

from eagle3_hf import Eagle3DraftModel
from eagle3_hf.generation.drafting import DraftState, TreeBudget, build_greedy_trees, catch_up
from eagle3_hf.generation.tree import tree_depths
from eagle3_hf.modeling.layouts import save_eagle, save_speculators

FLAGS = ("fc_norm", "norm_output", "norm_before_fc", "norm_before_residual")
COMBINATIONS = [dict(zip(FLAGS, values)) for values in itertools.product((False, True), repeat=len(FLAGS))]


@contextlib.contextmanager
def no_warnings():
    """A block in which any warning fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def refusal(layout, flags):
    """The words the exporter of `layout` refuses `flags` with, or None where it writes them."""
    if layout == "speculators" and flags["fc_norm"] and flags["norm_before_fc"]:
        return r"speculators layout cannot express.*fc_norm=True with norm_before_fc=True \(speculators refuses"
    if layout == "eagle" and flags["norm_before_residual"]:
        return r"norm_before_residual=True \(vLLM applies it, SGLang and SpecForge do not"
    if layout == "eagle" and flags["norm_before_fc"]:
        return r"norm_before_fc=True \(vLLM and SGLang since its PR #32334 apply it, but SpecForge has no such norm"
    return None


def save(draft, layout, folder):
    if layout == "native":
        draft.save_pretrained(folder)
    elif layout == "speculators":
        save_speculators(draft, folder)
    else:
        save_eagle(draft, folder, include_embedding=True)


# ------------------------------------------------------------------------------------------------------------------
# round trips: every flag combination in every layout


@pytest.mark.parametrize("flags", COMBINATIONS, ids=lambda f: "+".join(k for k, v in f.items() if v) or "eagle3")
@pytest.mark.parametrize("layout", ["native", "speculators", "eagle"])
def test_every_flag_combination_round_trips_bit_exact_or_is_refused_with_the_reason(tmp_path, target, layout, flags):
    draft = randomized_draft(target, **flags)
    folder = tmp_path / layout
    why = refusal(layout, flags)
    if why is not None:
        with pytest.raises(ValueError, match=why):
            save(draft, layout, folder)
        assert not folder.exists()  # refused before anything is written
        return
    save(draft, layout, folder)
    written = json.loads((folder / "config.json").read_text())
    if layout == "speculators":
        assert {flag: written[flag] for flag in FLAGS} == flags
    elif layout == "eagle":
        # true written, false left out: absent is EAGLE-3 to every reader, an explicit false was not, once.
        assert written.get("fc_norm", False) == flags["fc_norm"] and written.get("norm_output") == (
            True if flags["norm_output"] else None
        )
        assert written["eagle_aux_hidden_state_layer_ids"] == [2, L // 2, L - 3]  # what vLLM reads
        assert written["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, L // 2 - 1, L - 4]  # SGLang
    if layout == "eagle" and flags["norm_output"]:
        with pytest.warns(UserWarning, match=r"norm_output=True: read as norm_output=True.*PR #879"):
            back = Eagle3DraftModel.from_pretrained(folder, dtype="auto")
        with no_warnings():
            confirmed = Eagle3DraftModel.from_pretrained(folder, dtype="auto", norm_output=True)  # chosen: silent
        assert_same_draft(draft, confirmed)
    else:
        with no_warnings():
            back = Eagle3DraftModel.from_pretrained(folder, dtype="auto")
    assert_same_draft(draft, back)  # weights bit for bit, every flag and the taps


# ------------------------------------------------------------------------------------------------------------------
# an EAGLE-3.1 draft in the official/SpecForge layout drafts exactly as the native one


def greedy_tree(draft, target, prompt):
    with torch.no_grad():
        hidden = target(prompt, output_hidden_states=True).hidden_states
    state = DraftState()
    state.add_verified(
        draft.target_features(hidden)[:, :-1], prompt[:, 1:], torch.ones_like(prompt[:, 1:], dtype=torch.bool)
    )
    catch_up(draft, state)
    return build_greedy_trees(draft, state, prompt[0, -1:], TreeBudget(depth=5, top_k=3, total_tokens=20))[0]


def test_an_eagle31_draft_in_the_official_layout_drafts_exactly_as_the_native_one(tmp_path, target):
    draft = randomized_draft(target, fc_norm=True, norm_output=True)
    draft.save_pretrained(tmp_path / "native")
    save_eagle(draft, tmp_path / "eagle")  # without the embedding, as SpecForge writes it
    native = Eagle3DraftModel.from_pretrained(tmp_path / "native", target=target)
    official = Eagle3DraftModel.from_pretrained(tmp_path / "eagle", target=target, norm_output=True)
    prompt = torch.randint(0, 1000, (1, 12), generator=torch.Generator().manual_seed(5))
    expected = greedy_tree(native, target, prompt)
    assert (
        int(tree_depths(expected.parents).max()) >= 3
    )  # fed-back states, which norm_output decides, build most of the tree
    got = greedy_tree(official, target, prompt)
    for name in ("tokens", "parents", "scores"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    # Read the SpecForge-before-PR-#879 way (the pre-norm state fed back), the same file drafts another tree.
    older = greedy_tree(
        Eagle3DraftModel.from_pretrained(tmp_path / "eagle", target=target, norm_output=False), target, prompt
    )
    assert not torch.equal(older.scores, expected.scores)


# ------------------------------------------------------------------------------------------------------------------
# reading the official/SpecForge layout field by field


def official(tmp_path, target, name="ckpt", edit=None, rename=None, **overrides):
    """An official/SpecForge checkpoint (config edited by `edit`, weight names by `rename`): (path, weights, spec)."""
    s = spec(**overrides)
    w = draft_weights(s, target)
    config = external_config(s)
    if edit is not None:
        edit(config)
    stored = {rename(k) if rename else k: v for k, v in w.items()}
    return write_checkpoint(tmp_path / name, config, stored, s), w, s


def load(path, target, **kwargs):
    return Eagle3DraftModel.from_pretrained(path, target=target, **kwargs)


def test_norm_output_reads_as_the_servers_read_it(tmp_path, target):
    def set_norm_output(value):
        return lambda c: c.__setitem__("norm_output", value)

    for name, value in (("absent", None), ("false", False)):
        path, w, s = official(tmp_path, target, name, edit=None if value is None else set_norm_output(value))
        if value is None:
            with no_warnings():
                draft = load(path, target)  # absent: EAGLE-3 to every reader of every version
        else:
            # An explicit false: EAGLE-3 to the servers, an lm_head over the un-normed state to SpecForge before
            # its PR #879, which nothing here builds: loaded as the servers read it, the other reading named.
            with pytest.warns(
                UserWarning,
                match=r"norm_output=False: read as norm_output=False, the way vLLM, SGLang, TensorRT-LLM and "
                r"SpecForge since its PR #879 \(EAGLE-3.*SpecForge from July 2026 until its PR #879 read it as "
                r"lm_head over the un-normed state",
            ):
                draft = load(path, target)
            with no_warnings():
                assert load(path, target, norm_output=False).config.norm_output is False  # chosen: no warning
        assert draft.config.norm_output is False
        w["embed_tokens.weight"] = target.get_input_embeddings().weight.detach()
        check_against_reference(draft, w, s)
    path, w, s = official(tmp_path, target, "true", edit=set_norm_output(True), fc_norm=True)
    w["embed_tokens.weight"] = target.get_input_embeddings().weight.detach()
    warning = (
        r"official/SpecForge config's norm_output=True: read as norm_output=True, the way vLLM, SGLang, "
        r"TensorRT-LLM and SpecForge since its PR #879 \(EAGLE-3.1.*SpecForge from July 2026 until its PR "
        r"#879 \(EAGLE-3: the pre-norm state fed back\) read it as norm_output=False. Pass norm_output="
    )
    with pytest.warns(UserWarning, match=warning):
        draft = load(path, target)
    check_against_reference(draft, w, {**s, "norm_output": True})  # the post-norm state fed back
    older = load(path, target, norm_output=False)  # SpecForge before PR #879 meant EAGLE-3
    assert older.config.norm_output is False
    check_against_reference(older, w, s)
    with pytest.raises(
        ValueError,
        match=r"norm_output=True was passed, but the official/SpecForge config's "
        r"norm_output=None can be read only as norm_output=False \(every reader\)",
    ):
        load(official(tmp_path, target, "plain")[0], target, norm_output=True)
    with pytest.raises(ValueError, match=r"norm_output='yes'; expected true, false or no such field"):
        load(official(tmp_path, target, "bad", edit=set_norm_output("yes"))[0], target)


def test_tap_ids_read_as_the_servers_read_them(tmp_path, target):
    def taps(inner=None, outer=None, count=None):
        def edit(c):
            c.pop("eagle_config", None)
            if inner is not None:
                c["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": inner}
            if outer is not None:
                c["eagle_aux_hidden_state_layer_ids"] = outer
            if count is not None:
                c["num_aux_hidden_states"] = count

        return edit

    for name, edit, expected in (
        ("sglang", taps(inner=[1, 3, 4]), [2, 4, 5]),  # output-of-layer ids, first 1: every SGLang adds one
        ("vllm", taps(outer=[3, 5, 6]), [3, 5, 6]),  # vLLM's top-level input-of-layer ids
        ("both", taps(inner=[1, 3, 4], outer=[2, 4, 5]), [2, 4, 5]),  # what this package writes
        ("none", taps(), [2, L // 2, L - 3]),  # every reader's default
        ("count", taps(inner=[1, 3, 4], count=3), [2, 4, 5]),
    ):
        with no_warnings():
            assert load(official(tmp_path, target, name, edit=edit)[0], target).config.target_layer_ids == expected

    path = official(tmp_path, target, "ambiguous", edit=taps(inner=[2, 4, 5]))[0]
    older = (
        r"SGLang before its PR #25454 and SpecForge \(output-of-layer ids, ours minus one\) read it as "
        r"target_layer_ids=\[3, 5, 6\]"
    )
    with pytest.warns(UserWarning, match=r"target_layer_ids=\[2, 4, 5\], the way SGLang since its PR #25454.*" + older):
        assert load(path, target).config.target_layer_ids == [2, 4, 5]
    # vLLM's top-level ids agree with today's SGLang, but not with the older readers: still said.
    both = official(tmp_path, target, "both-ambiguous", edit=taps(inner=[2, 4, 5], outer=[2, 4, 5]))[0]
    with pytest.warns(UserWarning, match=r"the way vLLM \(top-level, input-of-layer ids\) read it; " + older):
        assert load(both, target).config.target_layer_ids == [2, 4, 5]
    assert load(path, target, target_layer_ids=[3, 5, 6]).config.target_layer_ids == [3, 5, 6]
    with pytest.raises(
        ValueError,
        match=r"target_layer_ids=\[1, 1, 1\] was passed, but .* can be read only as "
        r"target_layer_ids=\[2, 4, 5\] \(.*\) or target_layer_ids=\[3, 5, 6\]",
    ):
        load(path, target, target_layer_ids=[1, 1, 1])
    bad = {
        "disagree": (
            taps(inner=[1, 3, 4], outer=[3, 5, 6]),
            r"eagle_aux_hidden_state_layer_ids=\[3, 5, 6\], which "
            r"vLLM reads, and eagle_config.eagle_aux_hidden_state_layer_ids=\[1, 3, 4\], which SGLang reads "
            r"as \[2, 4, 5\]",
        ),
        "four": (
            taps(inner=[1, 2, 3, 4]),
            r"eagle_config.eagle_aux_hidden_state_layer_ids are \[1, 2, 3, 4\]; "
            r"expected three",
        ),
        "count": (taps(count=4), r"num_aux_hidden_states=4; eagle3_hf drafts fuse exactly 3"),
        "no-fc": (
            lambda c: c.__setitem__("eagle_config", {"use_aux_hidden_state": False}),
            r"use_aux_hidden_state=false: this draft reads no target taps",
        ),
    }
    for name, (edit, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            load(official(tmp_path, target, name, edit=edit)[0], target)


def test_fusion_norms_read_as_the_servers_read_them(tmp_path, target):
    embedding = target.get_input_embeddings().weight.detach()
    # SpecForge's and SGLang's older names: `use_aux_norm` and aux_norm_{low,mid,high}.
    legacy = {"fc_norm.0.": "aux_norm_low.", "fc_norm.1.": "aux_norm_mid.", "fc_norm.2.": "aux_norm_high."}

    def rename(key):
        return next((new + key[len(old) :] for old, new in legacy.items() if key.startswith(old)), key)

    def use_aux_norm(c):
        c.pop("fc_norm")
        c["use_aux_norm"] = True

    path, w, s = official(tmp_path, target, "legacy", edit=use_aux_norm, rename=rename, fc_norm=True)
    draft = load(path, target)
    assert draft.config.fc_norm
    check_against_reference(draft, {**w, "embed_tokens.weight": embedding}, s)
    # fc_norm weights, no flag: applied as before (as trained), with a warning that the servers would not.
    path, w, s = official(tmp_path, target, "unflagged", edit=lambda c: c.pop("fc_norm"), fc_norm=True)
    with pytest.warns(
        UserWarning,
        match=r"holds fc_norm.\* weights but its config.json has no fc_norm.*vLLM and "
        r"SGLang would not",
    ):
        draft = load(path, target)
    check_against_reference(draft, {**w, "embed_tokens.weight": embedding}, s)
    # norm_before_fc, in eagle_config (NVIDIA's place, which vLLM reads first) or at the top level; and the residual.
    for name, edit in (
        ("inner", lambda c: c.update(eagle_config={"norm_before_fc": True})),
        ("outer", lambda c: c.update(norm_before_fc=True)),
    ):
        path, w, s = official(tmp_path, target, name, edit=edit, norm_before_fc=True)
        with pytest.warns(
            UserWarning,
            match=r"norm_before_fc: true, which vLLM and SGLang since its PR #32334 apply.*SpecForge has no such "
            r"norm and SGLang before that PR drops it",
        ):
            draft = load(path, target)
        check_against_reference(draft, {**w, "embed_tokens.weight": embedding}, s)
    path, w, s = official(tmp_path, target, "nbr", edit=lambda c: c.update(norm_before_residual=True), nbr=True)
    with pytest.warns(
        UserWarning,
        match=r"norm_before_residual: true, which vLLM applies.*SGLang runs this draft "
        r"with the un-normed residual",
    ):
        draft = load(path, target)
    check_against_reference(draft, {**w, "embed_tokens.weight": embedding}, s)
    bad = {
        "disagree": (
            dict(
                edit=lambda c: c.update(norm_before_fc=False, eagle_config={"norm_before_fc": True}),
                norm_before_fc=True,
            ),
            r"eagle_config.norm_before_fc=True but norm_before_fc=False",
        ),
        "pair": (
            dict(edit=lambda c: c.update(norm_before_fc=True), fc_norm=True, norm_before_fc=True),
            r"fc_norm=True with norm_before_fc=True \(speculators refuses the pair, vLLM applies input_norm "
            r"before the per-tap norms",
        ),
    }
    for name, (options, message) in bad.items():
        with pytest.raises(ValueError, match=message), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load(official(tmp_path, target, name, **options)[0], target)


def test_the_speculators_layout_refuses_what_its_readers_run_apart(tmp_path, target):
    s = spec(layout="speculators", fc_norm=True, norm_before_fc=True, embed="target")
    with pytest.raises(ValueError, match=r"speculators config sets fc_norm=True with norm_before_fc=True"):
        Eagle3DraftModel.from_pretrained(
            write_checkpoint(tmp_path / "pair", external_config(s), draft_weights(s, target), s)
        )
    s = spec(layout="speculators", embed="target")
    config = {**external_config(s), "num_aux_hidden_states": 4}
    with pytest.raises(ValueError, match=r"num_aux_hidden_states=4; eagle3_hf drafts fuse exactly 3"):
        Eagle3DraftModel.from_pretrained(write_checkpoint(tmp_path / "four", config, draft_weights(s, target), s))


def test_a_speculators_config_without_norm_before_residual_reads_as_vllm_does(tmp_path, target):
    # vLLM defaults the field to True for this layout (speculators' own class to False): loaded as vLLM runs it.
    s = spec(layout="speculators", nbr=True, embed="target")
    config = external_config(s)
    del config["norm_before_residual"]
    w = draft_weights(s, target)
    path = write_checkpoint(tmp_path / "spec", config, w, s)
    with pytest.warns(
        UserWarning,
        match=r"speculators config has no norm_before_residual: read as norm_before_residual=True .*the way vLLM "
        r"reads it; speculators' own config class defaults to False",
    ):
        draft = Eagle3DraftModel.from_pretrained(path)
    assert draft.config.norm_before_residual is True
    check_against_reference(draft, w, s)  # the normed residual, as vLLM computes it
    with no_warnings():  # stated: read as written, and every export states it
        save_speculators(draft, tmp_path / "again")
        assert Eagle3DraftModel.from_pretrained(tmp_path / "again").config.norm_before_residual is True


def test_a_reading_a_checkpoint_states_one_way_must_agree(tmp_path, target):
    draft = randomized_draft(target, norm_output=True)
    draft.save_pretrained(tmp_path / "native")
    save_speculators(draft, tmp_path / "spec")
    for layout in ("native", "spec"):
        path = tmp_path / layout
        assert Eagle3DraftModel.from_pretrained(path, norm_output=True, target_layer_ids=[2, 4, 5]).config.norm_output
        with pytest.raises(
            ValueError,
            match=r"norm_output=False was passed, but the (native|speculators) checkpoint "
            r".* can be read only as norm_output=True \(as it states\)",
        ):
            Eagle3DraftModel.from_pretrained(path, norm_output=False)
        with pytest.raises(
            ValueError,
            match=r"target_layer_ids=\[3, 3, 3\] was passed, .* can be read only as "
            r"target_layer_ids=\[2, 4, 5\]",
        ):
            Eagle3DraftModel.from_pretrained(path, target_layer_ids=[3, 3, 3])
    with pytest.raises(ValueError, match="norm_output must be True or False, got 'true'"):
        Eagle3DraftModel.from_pretrained(tmp_path / "native", norm_output="true")


def test_the_official_export_refuses_taps_its_readers_would_read_apart(tmp_path, target):
    draft = randomized_draft(target, target_layer_ids=[3, 3, 3])
    with pytest.raises(
        ValueError,
        match=r"target_layer_ids=\[3, 3, 3\] \(SGLang reads the layout's output-of-layer "
        r"ids as such only when the first is 1",
    ):
        save_eagle(draft, tmp_path / "eagle")
    save_speculators(draft, tmp_path / "spec")  # input-of-layer ids, which every speculators reader takes as they are
    assert Eagle3DraftModel.from_pretrained(tmp_path / "spec").config.target_layer_ids == [3, 3, 3]
