"""The TTT steps run the draft's own forward: losses and gradients equal the parallel forward training used to have,
with its dense attention (to 1e-5 in fp32, to bf16 rounding under autocast), and a training step calls the draft, each layer and the head
through their own calls, with nothing patched."""

import contextlib
import pathlib
from collections import Counter

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from eagle3_hf import Eagle3DraftModel
from eagle3_hf.modeling.masks import causal_mask
from eagle3_hf.training import distributed
from eagle3_hf.training.head_loss import head_cross_entropy, ttt_head_kwargs
from eagle3_hf.training.trainer import Eagle3Trainer, Eagle3TrainingArguments
from eagle3_hf.training.ttt import shift_left, target_top_k, ttt_forward, ttt_loss
from eagle3_hf.training.ttt_layer import repeat_kv
from eagle3_hf.utils import tiny

torch.set_num_threads(1)
ROOT = pathlib.Path(__file__).parents[1]

V = 96
SHAPE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=V,
)


def joint_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    mask: torch.Tensor,
    scaling: float,
    softcap: float | None,
) -> torch.Tensor:
    """The former dense attention (before #46 item 4): attention of q ``[B, h, S, d]`` over the causal keys ``keys[0]`` ``[B, h, S, d]`` and the diagonal keys.

    `keys[1:]` (steps 1..j) are seen only at the query's own position: their scores are ``(q * k_i).sum(-1)``, appended
    as extra columns ``[B, h, S, j]`` before one softmax. `mask` is the additive ``[B, 1, S, S]`` causal/padding mask.
    Returns ``[B, h, S, d]``.
    """
    scores = torch.matmul(q, keys[0].transpose(-1, -2))  # [B, h, S, S]
    if len(keys) > 1:
        diagonal = torch.stack([(q * k).sum(-1) for k in keys[1:]], dim=-1)  # [B, h, S, j]
        scores = torch.cat([scores, diagonal], dim=-1)  # [B, h, S, S+j]
    scores = scores * scaling
    if softcap is not None:  # Gemma-style logit soft-capping, as the family's eager attention does
        scores = torch.tanh(scores / softcap) * softcap
    if len(keys) > 1:
        mask = torch.nn.functional.pad(mask, (0, len(keys) - 1))  # the diagonal columns are always visible
    probs = torch.softmax(scores + mask, dim=-1, dtype=torch.float32).to(values[0].dtype)
    seq = keys[0].shape[-2]
    out = torch.matmul(probs[..., :seq], values[0])  # [B, h, S, d]
    for i, v in enumerate(values[1:]):
        out = out + probs[..., seq + i, None] * v
    return out


def _former_ttt_forward(draft, input_ids, features, attention_mask, ttt_length):
    """The TTT unroll as training/ttt.py and ttt_layer.py wrote it out beside the model's forward (before #49 item 1):
    each step's normed states."""
    dtype = draft.fc.weight.dtype
    hidden = draft.fuse(features.to(dtype))
    device_type = hidden.device.type
    compute_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    batch, seq = input_ids.shape
    mask = causal_mask(batch, seq, 0, attention_mask, compute_dtype, hidden.device)
    positions = torch.arange(seq)[None].expand(batch, seq)
    previous = [[] for _ in draft.draft_layers()]
    states = []
    for step in range(ttt_length):
        embeds = draft.embed_tokens(shift_left(input_ids, 1 + step)).to(dtype)
        cos, sin = draft.rotary_emb(hidden, positions + step)
        out = hidden
        for layer, earlier in zip(draft.draft_layers(), previous):
            attn = layer.self_attn
            x, residual = layer.layer_input(embeds, out)
            q, k, v = layer.qkv(x, (cos, sin))
            groups = attn.num_key_value_groups
            keys = [repeat_kv(t, groups) for t in [*earlier[0::2], k]]
            values = [repeat_kv(t, groups) for t in [*earlier[1::2], v]]
            softcap = getattr(attn, "attn_logit_softcapping", None)
            attended = joint_attention(q, keys, values, mask, attn.scaling, softcap)
            out = layer.finish(residual, attn.o_proj(attended.transpose(1, 2).reshape(*embeds.shape[:-1], -1)))
            earlier += [k, v]
        normed = draft.norm(out)
        states.append(normed)
        hidden = normed if draft.config.norm_output else out
    return states


def _pair(family, **overrides):
    torch.manual_seed(0)
    if family == "qwen3":
        target = Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=16)).eval()
    else:
        target = LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()
    draft = Eagle3DraftModel.from_target(target, draft_vocab_size=40, **overrides)
    with torch.no_grad():  # away from the init (norms at 1, ...) so that every weight matters
        for name, param in draft.named_parameters():
            if name != "embed_tokens.weight":
                param.add_(torch.randn_like(param) * 0.2)
    return target, draft.train()


def _loss_and_grads(draft, batch, forward, autocast):
    draft.zero_grad()
    ids, features, attention_mask, loss_mask, top_logits, top_ids = batch
    dtype = None if autocast is contextlib.nullcontext else torch.bfloat16
    with autocast():
        if forward == "model":
            states = ttt_forward(draft, ids, features, attention_mask, ttt_length=3, return_hidden=True)
            heads = ttt_head_kwargs(draft.lm_head, autocast, dtype)
        else:  # what the former trainer ran: head_cross_entropy on the head's weight

            def former_head(rows, p, columns):
                return head_cross_entropy(rows, draft.lm_head.weight, p, columns, dtype)

            states = _former_ttt_forward(draft, ids, features, attention_mask, 3)
            heads = {"fused_head": former_head}
    out = ttt_loss(states, top_logits, loss_mask, draft.t2d, target_ids=top_ids, **heads)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}


CASES = {
    "llama": ("llama", {}),
    "llama-2-layers-norm-output": ("llama", dict(num_hidden_layers=2, norm_output=True)),
    "qwen3-3-layers": ("qwen3", dict(num_hidden_layers=3, norm_before_residual=True)),
}


@pytest.mark.parametrize("family, overrides", CASES.values(), ids=CASES.keys())
def test_ttt_losses_and_gradients_equal_the_former_training_forward(family, overrides):
    target, draft = _pair(family, **overrides)
    ids = torch.randint(1, V, (2, 10))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 7:] = 0  # a right-padded row
    ids = ids * attention_mask
    with torch.no_grad():
        out = target(ids, attention_mask=attention_mask, output_hidden_states=True)
    top_logits, top_ids = target_top_k(out.logits, 8)
    batch = (ids, draft.target_features(out.hidden_states), attention_mask, attention_mask, top_logits, top_ids)
    fp32 = contextlib.nullcontext
    model, model_grads = _loss_and_grads(draft, batch, "model", fp32)
    former, former_grads = _loss_and_grads(draft, batch, "former", fp32)
    # The chunked attention merges in log space: equal to the dense softmax up to fp32 rounding.
    torch.testing.assert_close(model.loss, former.loss, rtol=1e-5, atol=1e-5)
    assert torch.equal(model.step_correct, former.step_correct)
    assert model_grads.keys() == former_grads.keys() and "lm_head.weight" in model_grads
    for name, grad in model_grads.items():
        torch.testing.assert_close(grad, former_grads[name], rtol=1e-5, atol=1e-5, msg=name)
        assert grad.abs().sum() > 0, name

    # Under bf16 autocast the forward casts the token embeddings to the state's bf16 (the former loop kept them in
    # fp32 until the layer's matmuls), and the attention rounds in other places: both are as close to the fp32
    # result as each other (each a few % of a gradient's largest entry).
    def bf16():
        return torch.autocast("cpu", dtype=torch.bfloat16)

    model, model_bf16 = _loss_and_grads(draft, batch, "model", bf16)
    former, former_bf16 = _loss_and_grads(draft, batch, "former", bf16)
    torch.testing.assert_close(model.loss, former.loss, rtol=2e-2, atol=1e-3)
    for name, fp32_grad in former_grads.items():
        scale = float(fp32_grad.abs().max())
        error, former_error = [float((g[name] - fp32_grad).abs().max()) / scale for g in (model_bf16, former_bf16)]
        assert error <= 2 * former_error + 0.01 and error < 0.1, (name, error, former_error)


def test_reentrant_checkpointing_is_refused():
    target, draft = _pair("llama")
    ids = torch.randint(1, V, (1, 6))
    with torch.no_grad():
        features = draft.target_features(target(ids, output_hidden_states=True).hidden_states)
    draft.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match="use_reentrant"):
        ttt_forward(draft, ids, features, ttt_length=2)


def test_a_training_step_calls_the_draft_each_layer_and_the_head_unpatched(tmp_path):
    target, dataset = tiny.make_tiny_target(), tiny.synthetic_dataset()
    torch.manual_seed(0)
    draft = Eagle3DraftModel.from_target(target, draft_vocab_size=48, num_hidden_layers=2)
    calls, patched = Counter(), []
    modules = {"draft": draft, "layer 0": draft.midlayer, "layer 1": draft.upper_layers[0], "head": draft.lm_head}
    for name, module in modules.items():

        def hook(module, args, output, name=name):
            calls[name] += 1
            patched.extend([name] if "forward" in vars(module) else [])  # an instance `forward` shadows the class's

        module.register_forward_hook(hook)
    args = Eagle3TrainingArguments(
        str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=4,
        ttt_length=3,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    Eagle3Trainer(draft, args, target=target, train_dataset=dataset).train()
    # one call of the draft per TTT step, which calls each layer once; the head once, for every step's rows and loss
    assert calls == {"draft": 3, "layer 0": 3, "layer 1": 3, "head": 1}
    assert not patched and not hasattr(distributed, "routed_forward")
    with pytest.raises(ValueError, match="ddp_find_unused_parameters"):
        Eagle3TrainingArguments(str(tmp_path), ddp_find_unused_parameters=True, use_cpu=True)
