"""Small transformers MoE models built from config objects (no downloads), for the tests and
``bench.overlap --model``.

``build(family, size)`` returns a float32 ``*ForCausalLM`` in train mode with eager attention, its
weights drawn from one seed (routers and DeepSeek's selection bias included, so that no two experts
tie), dropout off and the model's own load-balancing loss on (``output_router_logits``).
"""

from __future__ import annotations

import torch

FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "deepseek_v3", "glm4_moe", "gpt_oss")

# Per size: hidden, heads, kv heads, layers, experts, top-k, expert hidden, vocab.
SIZES = {
    "tiny": dict(hidden=32, heads=4, kv=2, layers=2, experts=8, top_k=2, ffn=24, vocab=96),
    "bench": dict(hidden=128, heads=4, kv=2, layers=2, experts=8, top_k=2, ffn=256, vocab=512),
}


def _common(s: dict) -> dict:
    """The config fields every family shares at sizes ``s``."""
    return dict(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv"],
        max_position_embeddings=256,
        output_router_logits=True,
        router_aux_loss_coef=0.02,
        num_experts_per_tok=s["top_k"],
        attention_dropout=0.0,
        use_cache=False,
        tie_word_embeddings=False,
    )


def _deepseek_like(s: dict) -> dict:
    """DeepSeek-V3's and GLM-4-MoE's fields: shared expert, grouped routing, the first layer dense."""
    return dict(
        intermediate_size=2 * s["ffn"],
        moe_intermediate_size=s["ffn"],
        n_routed_experts=s["experts"],
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        num_hidden_layers=s["layers"] + 1,  # the first layer dense, as in the real models
    )


def _deepseek_v3(s: dict) -> dict:
    head = s["hidden"] // s["heads"]
    return dict(
        _deepseek_like(s),
        num_key_value_heads=s["heads"],  # multi-head latent attention: as many as query heads
        q_lora_rank=None,
        kv_lora_rank=head,
        qk_rope_head_dim=head // 2,
        qk_nope_head_dim=head // 2,
        v_head_dim=head,
    )


#: Per family: its transformers config class and its own fields at sizes ``s`` (over :func:`_common`'s).
_FAMILY_CONFIGS = {
    "mixtral": (
        "MixtralConfig",
        lambda s: dict(intermediate_size=s["ffn"], num_local_experts=s["experts"], router_jitter_noise=0.0),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        lambda s: dict(
            intermediate_size=2 * s["ffn"],
            moe_intermediate_size=s["ffn"],
            num_experts=s["experts"],
            norm_topk_prob=True,
            head_dim=s["hidden"] // s["heads"],
        ),
    ),
    "olmoe": (
        "OlmoeConfig",
        lambda s: dict(
            intermediate_size=s["ffn"], num_experts=s["experts"], norm_topk_prob=False, pad_token_id=1, eos_token_id=2
        ),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        lambda s: dict(
            intermediate_size=2 * s["ffn"],
            moe_intermediate_size=s["ffn"],
            shared_expert_intermediate_size=2 * s["ffn"],
            num_experts=s["experts"],
            norm_topk_prob=False,
        ),
    ),
    "deepseek_v3": ("DeepseekV3Config", _deepseek_v3),
    "glm4_moe": ("Glm4MoeConfig", _deepseek_like),
    "gpt_oss": (
        "GptOssConfig",
        lambda s: dict(
            intermediate_size=s["ffn"],
            num_local_experts=s["experts"],
            head_dim=s["hidden"] // s["heads"],
            sliding_window=8,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
}


def config(family: str, size="tiny", **overrides):
    """The transformers config of ``family`` at ``size``: a name in :data:`SIZES` or such a dict."""
    import transformers as tf

    if family not in _FAMILY_CONFIGS:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    s = SIZES[size] if isinstance(size, str) else size
    cls, fields = _FAMILY_CONFIGS[family]
    cfg = getattr(tf, cls)(**{**_common(s), **fields(s)})
    for k, v in overrides.items():
        setattr(cfg, k, v)
    cfg._attn_implementation = "eager"
    return cfg


def build(family: str, size="tiny", seed: int = 0, **overrides):
    """A float32 ``*ForCausalLM`` of ``family`` with weights from ``seed``, in train mode."""
    import transformers as tf

    cfg = config(family, size, **overrides)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")):
                p.normal_(std=0.5)  # routers are zeros at init in some families: break the ties
            elif name.endswith(("_bias", "router.bias")) and (".experts." in name or ".router." in name):
                p.normal_(std=0.1)  # GPT-OSS's expert and router biases start at zero: make them count
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(std=0.05)
    return model.train()


def batch(vocab: int, rows: int, seq: int, seed: int = 1, pad_rows: int = 1):
    """input_ids, attention_mask (the first ``pad_rows`` rows left-padded by a third) and labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[:pad_rows, : seq // 3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels
