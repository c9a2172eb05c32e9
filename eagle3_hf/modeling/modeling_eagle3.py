"""The EAGLE-3 draft model: `fc` over three target taps, one widened decoder layer (and optionally more), its head.

One draft step (EAGLE-3, arXiv 2503.01840; layouts in the official, SpecForge and speculators
checkpoints):

    g  = fc([h_low | h_mid | h_high])            target features -> H   (or g = fed-back state)
    a  = [input_layernorm(embed(x)) | hidden_norm(g)]                    [B, S, 2H]
    r  = g + attn(a)                             (hidden_norm(g) + attn(a) if norm_before_residual)
    o  = r + mlp(post_attention_layernorm(r))
    o  = layer_l(o) for l = 1..N-1               deeper drafts only (`upper_layers`, plain pre-norm layers)
    logits = lm_head(norm(o))                    over the draft vocabulary [B, S, Vd]
    feed back o (or norm(o) if norm_output)

The attention, MLP and norms are transformers' own classes for the target family. Decoding and training run this same
forward, each giving it the attention it needs (`DraftAttention`: a KV buffer over tree nodes; the TTT step's).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import ModelOutput
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from eagle3_hf.modeling.checkpoints import load_draft
from eagle3_hf.modeling.configuration_eagle3 import Eagle3DraftConfig
from eagle3_hf.modeling.decoder_layer import DraftAttention, Eagle3DecoderLayer
from eagle3_hf.modeling.embedding import set_embedding, stored_embedding, target_embedding
from eagle3_hf.modeling.families import get_family
from eagle3_hf.modeling.head import Eagle3Head
from eagle3_hf.modeling.masks import additive_mask, causal_mask
from eagle3_hf.modeling.model_card import CARD_NAME, build_model_card, is_our_card
from eagle3_hf.modeling.target_fit import check_target
from eagle3_hf.modeling.vocab_mapping import draft_to_target_ids, validate_vocab_mapping
from eagle3_hf.utils.atomic import apply_umask

# What training recorded about a draft (data, steps, command), saved next to it and shown on its model card.
TRAINING_INFO_NAME = "training_info.json"


@dataclass
class Eagle3DraftOutput(ModelOutput):
    """Output of [`Eagle3DraftModel.forward`].

    Args:
        logits: `[B, S, draft_vocab_size]` scores over the draft vocabulary (map ids with `d2t`).
        last_hidden_state: `[B, S, hidden_size]` the state to feed back as `hidden_states` on the next step.
        cache: the draft's KV cache, when one was given or `use_cache=True`.
        normed_hidden_state: `[B, S, hidden_size]` the head's input `norm(o)` (the logits are `lm_head` of it).
    """

    logits: torch.FloatTensor | None = None
    last_hidden_state: torch.FloatTensor | None = None
    cache: Cache | None = None
    normed_hidden_state: torch.FloatTensor | None = None


def select_target_features(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """Concatenate the tapped target states (indices into `output_hidden_states`) -> `[B, S, 3*Ht]`."""
    return torch.cat([hidden_states[i] for i in layer_ids], dim=-1)


class Eagle3PreTrainedModel(PreTrainedModel):
    config_class = Eagle3DraftConfig
    base_model_prefix = "eagle3"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Eagle3DecoderLayer"]
    _supports_sdpa = True
    _supports_attention_backend = True

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        # Gemma-style norms scale by (1 + weight): identity at zero.
        if "Gemma" in type(module).__name__ and "RMSNorm" in type(module).__name__:
            with torch.no_grad():
                module.weight.zero_()


class Eagle3DraftModel(Eagle3PreTrainedModel):
    r"""The EAGLE-3 draft model.

    It reads the target's fused low/mid/high hidden states (`target_hidden_states`, `[B, S, 3*Ht]`) or its own
    fed-back state (`hidden_states`, `[B, S, H]`) together with the tokens that follow them, and predicts the
    token after next over its own draft vocabulary.

    Example:

    ```python
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from eagle3_hf import Eagle3DraftModel
    >>> target = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8,
    ...                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=1000))
    >>> draft = Eagle3DraftModel.from_target(target, draft_vocab_size=200)
    >>> ids = torch.randint(0, 1000, (1, 6))
    >>> hs = target(ids, output_hidden_states=True).hidden_states
    >>> out = draft(ids, target_hidden_states=draft.target_features(hs))
    >>> out.logits.shape, out.last_hidden_state.shape
    (torch.Size([1, 6, 200]), torch.Size([1, 6, 64]))
    ```
    """

    def __init__(self, config: Eagle3DraftConfig) -> None:
        super().__init__(config)
        hidden, target_hidden = config.hidden_size, config.target_hidden_size
        norm = get_family(config.layer_type).norm_class
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden, config.pad_token_id)
        self.embed_tokens.weight.requires_grad_(False)  # the target's embedding, frozen
        if config.norm_before_fc:
            self.input_norm = norm(3 * target_hidden, eps=config.rms_norm_eps)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList([norm(target_hidden, eps=config.rms_norm_eps) for _ in range(3)])
        self.fc = nn.Linear(3 * target_hidden, hidden, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)  # layer 0; its name is the checkpoints' `midlayer.*`
        # Layers 1..N-1 of a deeper draft; empty for EAGLE-3's one layer (whose state dict stays as it was).
        self.upper_layers = nn.ModuleList(Eagle3DecoderLayer(config, i) for i in range(1, config.num_hidden_layers))
        self.norm = norm(hidden, eps=config.rms_norm_eps)
        self.lm_head = Eagle3Head(hidden, config.draft_vocab_size, bias=False)
        rope_config = LlamaConfig(
            hidden_size=hidden,
            num_attention_heads=config.num_attention_heads,
            head_dim=config.head_dim,
            rope_parameters=dict(config.rope_parameters),
            max_position_embeddings=config.max_position_embeddings,
        )
        self.rotary_emb = LlamaRotaryEmbedding(config=rope_config)
        # d2t: offsets, target_id = draft_id + d2t[draft_id]; t2d: target ids inside the draft vocabulary.
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        # Set with the dtype the target's embedding came in by `set_embedding` (from_target, loaders); exports use it.
        self.embedding_loaded = False
        self.embedding_dtype: torch.dtype | None = None
        self.training_info: dict[str, Any] | None = None  # written by save_pretrained (training_info.json, card)
        self.gradient_checkpointing = False
        self.post_init()

    # ----------------------------------------------------------------------------------------------
    # construction
    @classmethod
    def from_target(
        cls, target: PreTrainedModel, draft_vocab_size: int | None = None, **config_overrides: Any
    ) -> Eagle3DraftModel:
        """A freshly initialised draft for `target`: config derived from the target's (`config_overrides` checked
        against it), embedding copied, in the target's dtype and device (for generation, `eagle3_hf.bind_target`)."""
        config = Eagle3DraftConfig.from_target_config(
            target.config, draft_vocab_size=draft_vocab_size, **config_overrides
        )
        check_target(config, target)
        draft = cls(config)
        draft.load_target_embedding(target)
        ref = target.get_input_embeddings().weight
        return draft.to(device=ref.device, dtype=ref.dtype)

    def load_target_embedding(self, target: PreTrainedModel) -> None:
        """Copy (and freeze) the target's token embedding, exactly (`set_embedding`), gathered from an FSDP2 target."""
        set_embedding(self, target_embedding(target))

    @property
    def dtype(self) -> torch.dtype:
        """The draft's own weights' dtype (what save_pretrained records), not the maybe wider embedding's."""
        return self._modules["fc"].weight.dtype if "fc" in self._modules else super().dtype

    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install a draft vocabulary mapping (offsets `d2t` `[Vd]`, membership `t2d` `[V]`), after checking it."""
        validate_vocab_mapping(d2t, t2d, self.config.vocab_size)
        if d2t.numel() != self.config.draft_vocab_size:
            raise ValueError(
                f"d2t has {d2t.numel()} entries but the draft head predicts draft_vocab_size="
                f"{self.config.draft_vocab_size} tokens."
            )
        self.d2t.copy_(d2t.to(self.d2t.device, torch.long))
        self.t2d.copy_(t2d.to(self.t2d.device, torch.bool))

    # ----------------------------------------------------------------------------------------------
    # helpers used by generation and training
    def draft_layers(self) -> list[Eagle3DecoderLayer]:
        """The decoder layers in order: `midlayer`, then `upper_layers`."""
        return [self.midlayer, *self.upper_layers]

    def target_features(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Fused-input features `[B, S, 3*Ht]` from a target's `output_hidden_states`."""
        layer_ids = self.config.resolved_target_layer_ids(len(hidden_states) - 1)
        return select_target_features(hidden_states, layer_ids)

    def draft_to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target ids through the `d2t` offsets."""
        return draft_to_target_ids(draft_ids, self.d2t)

    def fuse(self, target_hidden_states: torch.Tensor) -> torch.Tensor:
        """`fc` over the three taps, with the optional per-tap / joint norms of later checkpoints."""
        expected = 3 * self.config.target_hidden_size
        if target_hidden_states.shape[-1] != expected:
            raise ValueError(
                f"target_hidden_states must have last dimension 3*target_hidden_size={expected} "
                f"(low|mid|high taps), got shape {tuple(target_hidden_states.shape)}."
            )
        x = target_hidden_states
        if self.config.fc_norm:
            x = torch.cat([n(c) for n, c in zip(self.fc_norm, x.chunk(3, dim=-1))], dim=-1)
        if self.config.norm_before_fc:
            x = self.input_norm(x)
        return self.fc(x)

    # ----------------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.LongTensor,
        target_hidden_states: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        attention: DraftAttention | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        skip_logits: bool = False,
        **kwargs: Any,
    ) -> Eagle3DraftOutput:
        r"""One draft step over `S` positions.

        Args:
            input_ids: `[B, S]` the tokens that follow each feature position (x_{t+1} for feature h_t).
            target_hidden_states: `[B, S, 3*Ht]` the target taps low|mid|high; `fc` is applied.
            hidden_states: `[B, S, H]` the draft's own fed-back state. Give exactly one of the two.
            position_ids: `[B, S]` RoPE positions; default continues after the cache.
            attention_mask: 2D padding mask `[B, past+S]`, or a 4D mask `[B, 1, S, past+S]` (bool or additive); with
                `attention`, whatever that object reads, passed to it as it is.
            cache: a transformers `Cache` holding the draft's earlier keys/values.
            logits_to_keep: if > 0, compute logits only for the last that many positions.
            attention: a `DraftAttention` that every layer attends with instead of the family's attention module and
                a cache (it keeps the keys/values itself): decoding's buffer over tree nodes, the TTT step's joint
                attention. No mask is built and no cache is used.
            position_embeddings: RoPE `(cos, sin)` for the positions, when the caller has them; else computed.
            skip_logits: leave the head out (`logits` is None; `normed_hidden_state` is its input), for callers
                that run it on some rows only.
        """
        if kwargs.get("past_key_values") is not None and cache is None:
            cache = kwargs.pop("past_key_values")
        if (target_hidden_states is None) == (hidden_states is None):
            raise ValueError(
                "Eagle3DraftModel.forward needs exactly one of `target_hidden_states` (the target's fused taps, "
                "[B, S, 3*Ht]) or `hidden_states` (the draft's fed-back state, [B, S, H])."
            )
        if not self.embedding_loaded:
            raise ValueError(
                "This draft has no token embedding: the checkpoint did not include one. Pass the target, e.g. "
                "`Eagle3DraftModel.from_pretrained(path, target=target)` or `draft.load_target_embedding(target)`."
            )
        if attention is not None and (cache is not None or use_cache):
            raise ValueError(
                "Give Eagle3DraftModel.forward a cache or an `attention` (which keeps its keys), not both."
            )
        batch, seq = input_ids.shape
        if hidden_states is None:
            hidden_states = self.fuse(target_hidden_states)
        elif hidden_states.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"hidden_states must have last dimension hidden_size={self.config.hidden_size}, "
                f"got shape {tuple(hidden_states.shape)}."
            )
        if use_cache and cache is None:
            cache = DynamicCache()
        past = cache.get_seq_length() if cache is not None else 0
        if attention is not None:  # the attention object reads the mask as it is
            mask = attention_mask
        elif attention_mask is None or attention_mask.dim() == 2:
            mask = causal_mask(batch, seq, past, attention_mask, hidden_states.dtype, hidden_states.device)
        elif attention_mask.dtype == torch.bool:
            mask = additive_mask(attention_mask, hidden_states.dtype)
        else:
            mask = attention_mask
        embeds = self.embed_tokens(input_ids).to(hidden_states.dtype)
        if position_embeddings is None:
            if position_ids is None:
                position_ids = torch.arange(past, past + seq, device=input_ids.device)[None].expand(batch, seq)
            position_embeddings = self.rotary_emb(hidden_states, position_ids)
        out = hidden_states
        for layer in self.draft_layers():  # the same mask and positions; the cache keeps one entry per layer
            layer.self_attn.config._attn_implementation = self.config._attn_implementation
            args = (embeds, out, position_embeddings, mask, cache, attention)
            if self.gradient_checkpointing and self.training:
                out = self._gradient_checkpointing_func(layer.__call__, *args)
            else:
                out = layer(*args)
        normed = self.norm(out)
        logits = None
        if not skip_logits:
            logits = self.lm_head(normed[:, -logits_to_keep:] if logits_to_keep > 0 else normed)
        feedback = normed if self.config.norm_output else out
        return Eagle3DraftOutput(logits=logits, last_hidden_state=feedback, cache=cache, normed_hidden_state=normed)

    # ----------------------------------------------------------------------------------------------
    # checkpoints (layout detection and loading live in eagle3_hf.modeling.checkpoints)
    @classmethod
    def from_pretrained(  # type: ignore[override]
        cls, pretrained_model_name_or_path: str, *model_args: Any, target: PreTrainedModel | None = None, **kwargs: Any
    ) -> Eagle3DraftModel:
        """Load a draft (a folder, a shipped draft's name such as "smollm2-135m-instruct", or a Hub id) in the
        native, official (SafeAILab), SpecForge or speculators layout (detected). With `target`, the draft is
        checked against it (hidden size, vocabulary, depth), takes its token embedding when the checkpoint has none,
        and takes its dtype and device; `eagle3_hf.bind_target(draft, target)` then makes
        `target.generate(..., assistant_model=draft)` run EAGLE-3 tree decoding.
        """
        return load_draft(cls, pretrained_model_name_or_path, *model_args, target=target, **kwargs)

    def save_pretrained(  # type: ignore[override]
        self,
        save_directory: str | os.PathLike,
        is_main_process: bool = True,
        state_dict: dict[str, torch.Tensor] | None = None,
        include_embedding: bool = True,
        **kwargs: Any,
    ) -> Any:
        """`PreTrainedModel.save_pretrained`, optionally without the (target's, frozen) token embedding, plus the
        model card (README.md, see `eagle3_hf.modeling.model_card`) and `training_info.json` when
        `self.training_info` holds what training recorded.

        `include_embedding=False` keeps shipped drafts small; loading one then needs `target=`. An embedding that was
        never loaded is always left out: it holds random values until the draft gets the target's, and saving them
        would make a later load take them for a real embedding. A loaded one is written in the dtype it came in, bit
        for bit (`stored_embedding`). A README.md this library did not write is kept.
        """
        if state_dict is None:
            state_dict = {k: v for k, v in self.state_dict().items() if k != "embed_tokens.weight"}
            if self.embedding_loaded and include_embedding:
                state_dict["embed_tokens.weight"] = stored_embedding(self)
        result = super().save_pretrained(save_directory, is_main_process, state_dict, **kwargs)
        if is_main_process:
            self._save_card(os.fspath(save_directory))
            apply_umask(save_directory, suffix=".safetensors")  # safetensors writes 0600, whatever the umask
        return result

    def _save_card(self, folder: str) -> None:
        info_path = os.path.join(folder, TRAINING_INFO_NAME)
        info = dict(getattr(self, "training_info", None) or {})
        if info:
            with open(info_path, "w", encoding="utf-8") as f:
                json.dump(info, f, indent=2)
                f.write("\n")
        elif os.path.isfile(info_path):
            with open(info_path, encoding="utf-8") as f:
                info = json.load(f)
        card_path = os.path.join(folder, CARD_NAME)
        if not os.path.isfile(card_path) or is_our_card(card_path):
            build_model_card(self.config, info).save(card_path)

    def push_to_hub(  # type: ignore[override]
        self,
        repo_id: str,
        *,
        commit_message: str | None = None,
        private: bool | None = None,
        token: bool | str | None = None,
        revision: str | None = None,
        create_pr: bool = False,
        include_embedding: bool = True,
        **save_kwargs: Any,
    ) -> Any:
        """Upload the draft, as `save_pretrained` writes it (model card included), to the Hub repo `repo_id`."""
        from huggingface_hub import HfApi

        api = HfApi(token=token if isinstance(token, str) else None)
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        with tempfile.TemporaryDirectory() as folder:
            self.save_pretrained(folder, include_embedding=include_embedding, **save_kwargs)
            return api.upload_folder(
                repo_id=repo_id,
                folder_path=folder,
                commit_message=commit_message or "Upload EAGLE-3 draft",
                revision=revision,
                create_pr=create_pr,
            )

    def __getattr__(self, name: str) -> Any:
        if name == "generation_config":
            # Read by stock assisted generation, which is what runs when a target was never bound to this draft.
            raise AttributeError(
                "Eagle3DraftModel has no generation_config: it is not a standalone generator and cannot serve stock "
                "assisted generation (chains without target hidden states). Bind the target to it first -- "
                "`eagle3_hf.bind_target(draft, target)` -- then call `target.generate(..., assistant_model=draft)`."
            )
        return super().__getattr__(name)


__all__ = ["Eagle3DraftModel", "Eagle3DraftOutput", "Eagle3PreTrainedModel", "Eagle3DecoderLayer"]
