"""Features saved while regenerating: equal to a separate prefill's (`eagle3-hf features` on the answers), taken from
the generation's own forwards, resumable, and read by `train --features`."""

import json
import os

import pytest
import torch
from helpers.cli_argv import argv
from helpers.regenerate import CountingGenerate, conversations, tiny_llama

from eagle3_hf import Eagle3DraftModel
from eagle3_hf.cli import main as cli_main
from eagle3_hf.training import regenerate_features
from eagle3_hf.training.feature_dataset import OfflineFeatureDataset
from eagle3_hf.training.features import precompute_features
from eagle3_hf.training.regenerate import regenerate_responses
from eagle3_hf.training.regenerate_features import SaveFeatures
from eagle3_hf.training.split import is_held_out, split_filter
from eagle3_hf.training.tokenise import tokenise_data

MAX_NEW_TOKENS = 6
HELD_OUT = 0.3  # of conv-0..conv-5, conv-1 and conv-2 are held out at this fraction (checked below)


@pytest.fixture(scope="module")
def model(tokenizer_dir):
    """A tiny random 4-layer Llama over SmolLM2's vocabulary (4 layers: taps 2, 2, 1), in fp32."""
    return tiny_llama(tokenizer_dir, num_hidden_layers=4)


@pytest.fixture
def early_stop(model, tokenizer):
    """Also stop answers at a token the model writes early in one answer but not in all: in a batch some rows then
    finish (and are fed padding) while others go on."""
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": c["conversations"][0]["value"]}], add_generation_prompt=True
        )["input_ids"]
        for c in conversations(3)
    ]
    answers = [
        model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)[0, len(p) :].tolist()
        for p in prompts
    ]
    stop = answers[0][1]
    assert any(stop not in a[:-1] for a in answers[1:])  # another row goes on past it
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, stop]
    yield stop
    model.generation_config.eos_token_id = saved


def save(folder, **kwargs):
    options = {"held_out_fraction": HELD_OUT, "top_k": 8, "dtype": torch.float32, "batch_size": 2, **kwargs}
    return SaveFeatures(folder / "train", folder / "held_out", **options)


def regenerate(model, tokenizer, answers, **kwargs):
    options = {"batch_size": 3, "max_new_tokens": MAX_NEW_TOKENS, "shard_size": 4, **kwargs}
    return regenerate_responses(model, tokenizer, conversations(6), answers, **options)


def prefilled(model, tokenizer, answers, folder, split, dtype=torch.float32):
    """What `eagle3-hf features` writes from the answers folder (its tokenising and its batched prefill)."""
    rows, _ = tokenise_data(tokenizer, str(answers), 2048, select=split_filter(split, HELD_OUT))
    precompute_features(model, rows, folder, top_k=8, dtype=dtype, batch_size=4)
    return OfflineFeatureDataset(folder)


def assert_same_features(saved, prefill, storage=torch.float32):
    """Row for row the same tokens, loss masks and top-k ids, and features and logits equal up to rounding: the
    decode's forwards (one token at a time over a KV cache, left-padded) and the prefill's (whole rows, right-padded)
    multiply in other shapes, so their fp32 results differ by ~1e-5 at these magnitudes (atol 1e-4); stored in bf16,
    that difference can move a value to the neighbouring bf16 number, one unit in the last place (2**-7 relative, as
    bf16 keeps 8 significant bits)."""
    assert len(saved) == len(prefill) > 0
    assert saved.manifest["fingerprint"] == prefill.manifest["fingerprint"]  # every row's tokens and loss mask
    tolerance = {"atol": 1e-4, "rtol": 1e-4} if storage == torch.float32 else {"atol": 1e-4, "rtol": 2**-7}
    for i in range(len(saved)):
        a, b = saved[i], prefill[i]
        for key in ("input_ids", "loss_mask", "attention_mask", "target_top_ids"):
            assert torch.equal(a[key], b[key]), (i, key)
        for key in ("target_hidden_states", "target_top_logits"):
            assert a[key].dtype == storage
            torch.testing.assert_close(a[key].float(), b[key].float(), **tolerance, msg=f"row {i} {key}")


@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16])
def test_saved_features_equal_a_separate_prefill(model, tokenizer, early_stop, tmp_path, storage):
    assert [c["id"] for c in conversations(6) if is_held_out(c["id"], HELD_OUT)] == ["conv-1", "conv-2"]
    counts = []
    rows = regenerate_features.DecodeFeatures.rows

    def counting_rows(self, wanted):
        out = rows(self, wanted)
        counts.append((self.decoded_positions, self.continued_positions))
        return out

    answers = tmp_path / "answers"
    regenerate_features.DecodeFeatures.rows = counting_rows
    try:
        regenerate(model, tokenizer, answers, save_features=save(tmp_path, dtype=storage))
    finally:
        regenerate_features.DecodeFeatures.rows = rows
    for split, folder in (("train", "train"), ("held-out", "held_out")):
        saved = OfflineFeatureDataset(tmp_path / folder)
        assert saved.manifest["split"] == split and saved.manifest["source"] == "regenerate"
        prefill = prefilled(model, tokenizer, answers, tmp_path / f"p_{folder}", split, storage)
        assert_same_features(saved, prefill, storage)
    # The answers shards have 4 and 2 conversations, both held-out ones in the first: the second held-out features
    # shard is empty (and read as such).
    assert OfflineFeatureDataset(tmp_path / "held_out").manifest["shard_samples"] == [2, 0]
    assert OfflineFeatureDataset(tmp_path / "train").manifest["shard_samples"] == [2, 2]
    # Most positions come from the generation's own forwards; the rest (each answer's last token and the template's
    # tokens after it, and where the stripped text re-tokenises differently) from one short forward per batch.
    decoded, continued = counts[-1]
    assert continued < 0.2 * (decoded + continued)


def test_no_second_forward_over_the_answers(model, tokenizer, early_stop, tmp_path):
    """With features, the target reads the same prompts and answers in the same calls, plus one short forward per
    batch over its KV cache."""
    lengths = {"plain": [], "saving": []}
    for name, kwargs in (("plain", {}), ("saving", {"save_features": save(tmp_path)})):
        handle = model.register_forward_pre_hook(
            lambda m, a, k, name=name: lengths[name].append(tuple(k["input_ids"].shape)), with_kwargs=True
        )
        try:
            regenerate(model, tokenizer, tmp_path / name, **kwargs)
        finally:
            handle.remove()
    extra = list(lengths["saving"])
    for shape in lengths["plain"]:
        extra.remove(shape)  # every forward of the plain run happens too
    prefills = [width for _, width in lengths["plain"] if width > 1]  # one per generate call
    # One more forward per call, reading at most an answer again (re-tokenised: its first token may differ once
    # the text is stripped) and the template's end, never a prompt.
    assert len(extra) == len(prefills) and all(width <= 2 * MAX_NEW_TOKENS < min(prefills) for _, width in extra)
    assert sorted(os.listdir(tmp_path / "plain")) == sorted(os.listdir(tmp_path / "saving"))
    for name in ("shard_00000.jsonl", "shard_00001.jsonl"):  # and the same answers
        assert (tmp_path / "plain" / name).read_text() == (tmp_path / "saving" / name).read_text()


def test_a_killed_run_resumes_and_earlier_answers_get_features(model, tokenizer, early_stop, tmp_path, monkeypatch):
    """Answers written before features were asked for get theirs from a prefill; a run killed mid-way resumes."""
    answers = tmp_path / "answers"
    generate = CountingGenerate(model, fail_on_call=3)  # the first shard is written (3 calls), then the run dies
    monkeypatch.setattr(model, "generate", generate)
    with pytest.raises(RuntimeError, match="killed"):
        regenerate(model, tokenizer, answers)
    assert sorted(os.listdir(answers)) == [".regenerate.json", "shard_00000.jsonl"]
    monkeypatch.setattr(model, "generate", generate.generate)
    regenerate(model, tokenizer, answers, save_features=save(tmp_path))
    assert_same_features(
        OfflineFeatureDataset(tmp_path / "train"), prefilled(model, tokenizer, answers, tmp_path / "p", "train")
    )
    # Killed after the features of a shard but before its answers: the shard is redone, the folder stays readable.
    answers2, save2 = tmp_path / "answers2", save(tmp_path / "second")
    real_write = regenerate_features.RegeneratedFeatures.write

    def write_then_die(self, index, records, shard_size):
        real_write(self, index, records, shard_size)
        if index == 1:
            raise RuntimeError("killed")

    monkeypatch.setattr(regenerate_features.RegeneratedFeatures, "write", write_then_die)
    with pytest.raises(RuntimeError, match="killed"):
        regenerate(model, tokenizer, answers2, save_features=save2)
    assert len(OfflineFeatureDataset(save2.output_dir)) == 2  # the manifest counts the first shard only
    monkeypatch.setattr(regenerate_features.RegeneratedFeatures, "write", real_write)
    regenerate(model, tokenizer, answers2, save_features=save2)
    saved = OfflineFeatureDataset(save2.output_dir)
    assert_same_features(saved, OfflineFeatureDataset(tmp_path / "train"))
    # Another setting into the same folder is refused, naming it.
    with pytest.raises(ValueError, match="another run.*logits_top_k: 8 -> 4"):
        regenerate(model, tokenizer, answers2, save_features=save(tmp_path / "second", top_k=4))
    with pytest.raises(ValueError, match="folders of their own"):
        regenerate(model, tokenizer, answers2, save_features=SaveFeatures(answers2))


def test_regenerate_then_train_on_the_features(chat_target, tmp_path, capsys):
    """`regenerate --save-features` then `train --features` for two epochs, evaluated on the held-out features every
    2 steps, the best checkpoint (by simulated acceptance) kept and saved as the draft."""
    folder, data = chat_target
    answers, feats, held_out = tmp_path / "answers", tmp_path / "feats", tmp_path / "held_out"
    options = dict(
        target=folder, data=data, output=answers, no_dedupe=True, max_new_tokens=8, batch_size=4, shard_size=5
    )
    assert (
        cli_main(argv("regenerate", **options, save_features=feats, save_eval_features=held_out, logits_top_k=16)) == 0
    )
    assert "features of their answers in" in capsys.readouterr().out
    assert len(OfflineFeatureDataset(feats)) == 11 and len(OfflineFeatureDataset(held_out)) == 1
    # What `eagle3-hf features` writes from the answers folder, stored in bf16 by both.
    for split, saved in (("train", feats), ("held-out", held_out)):
        again = tmp_path / f"again_{split}"
        assert cli_main(argv("features", target=folder, data=answers, output=again, split=split, logits_top_k=16)) == 0
        assert_same_features(OfflineFeatureDataset(saved), OfflineFeatureDataset(again), torch.bfloat16)
    run = tmp_path / "run"
    train = argv(
        "train",
        target=folder,
        features=feats,
        eval_features=held_out,
        output=run,
        num_train_epochs=2,
        batch_size=4,
        ttt_length=2,
        draft_vocab_size=64,
        eval_steps=2,
        save_steps=2,
        metric_for_best_model="sim_accept_len",
        load_best_model_at_end=True,
    )
    assert cli_main(train) == 0
    state = json.loads((run / "trainer_state.json").read_text())
    assert state["global_step"] == 6 and state["num_train_epochs"] == 2  # 3 batches of 11 conversations, twice
    evals = [log for log in state["log_history"] if "eval_sim_accept_len" in log]
    assert [log["step"] for log in evals] == [2, 4, 6]
    best = max(evals, key=lambda log: log["eval_sim_accept_len"])
    assert state["best_model_checkpoint"] == str(run / f"checkpoint-{best['step']}")
    kept, saved = (Eagle3DraftModel.from_pretrained(str(p)) for p in (state["best_model_checkpoint"], run))
    for name, value in kept.state_dict().items():
        assert torch.equal(saved.state_dict()[name], value), name
