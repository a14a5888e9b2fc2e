"""Tiny configs of every decoder family the installed transformers ships, and what packing them gives.

    row = measure("bamba")     # Row(family, route, logits, loss, grads, refused)

`tiny_config` shrinks a family's default config (hidden 64, 2 layers, 4 heads, small state and expert sizes) and
keeps one layer of each kind a hybrid mixes (`layer_types`, `layers_block_type`, ...), so every mixer kind runs.
`measure` builds the model as `PackedCausalLM` does (construction probe included) and compares the packed forward
and backward with each example run alone (fp32, the `per_example` backend).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from lit_packing.data.collate import PackedCollator
from lit_packing.errors import ConfigError
from lit_packing.models.loading import load_causal_lm
from lit_packing.models.loss import token_losses
from lit_packing.models.mixers import find_mixers
from tests.helpers import per_example_reference

# Causal-LM heads on encoders (BERT-likes run as decoders), encoder-decoders, and multimodal models: not text-only
# decoder families.
NOT_DECODERS = frozenset(
    [
        "bert",
        "bert-generation",
        "big_bird",
        "camembert",
        "data2vec-text",
        "electra",
        "ernie",
        "megatron-bert",
        "rembert",
        "roberta",
        "roberta-prelayernorm",
        "roc_bert",
        "roformer",
        "xlm-roberta",
        "xlm-roberta-xl",
        "xmod",
        "xlm",
        "xlnet",
        "reformer",
        "cpmant",
        "blt",
        "git",
        "fuyu",
        "emu3",
        "mllama",
        "got_ocr2",
        "musicgen",
        "musicgen_melody",
        "moshi",
        "phi4_multimodal",
        "trocr",
        "whisper",
        "moss_transcribe_diarize",
        "dots3_note",
        "gemma3n",
        "gemma4",
        "gemma4_unified",
        "gemma4_unified_assistant",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen4_exp",
        "llama4",
        "gemma3",
        "bart",
        "bigbird_pegasus",
        "blenderbot",
        "blenderbot-small",
        "marian",
        "mbart",
        "mvp",
        "pegasus",
        "plbart",
        "prophetnet",
    ]
)
SMALL = dict(
    vocab_size=1000, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_local_experts=4,
    n_routed_experts=4, num_experts_per_tok=2, num_experts_per_token=2, max_position_embeddings=512, n_embd=64,
    n_head=4, n_layer=2, n_positions=512, embedding_dim=64, attention_hidden_size=64, lru_width=64,
    mamba_d_state=16, state_size=16, ssm_state_size=16, mamba_n_heads=8, mamba_d_head=16, mamba_num_heads=8,
    mamba_head_dim=16, n_mamba_heads=2, mamba_chunk_size=8, chunk_size=8, mamba_dt_rank=8, time_step_rank=8,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_heads=2, linear_head_dim=16, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
    qk_nope_head_dim=8, v_head_dim=16, qk_head_dim=16, n_groups=1, mamba_n_groups=1, num_heads=4, block_size=8,
    attention_window_size=8, sliding_window=8, attention_head_dim=16, num_mem_blocks=1, kv_channels=16,
    num_query_groups=2, mamba_headdim=16, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
    sliding_window_size=8, router_hidden_size=16, d_rel=4, rel_extent=16, first_k_dense_replace=1,
    num_nextn_predict_layers=0, n_shared_experts=1, num_shared_experts=1, n_group=1, topk_group=1,
    num_expert_group=1,
)  # fmt: skip
SIZES_OFTEN_NONE = ("head_dim", "num_key_value_heads", "num_experts_per_tok")
# Where the generic shrink is not enough: the family's own constraints.
OVERRIDES = {
    "mamba2": dict(num_heads=8, head_dim=16, expand=2),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "bamba": dict(attn_layer_indices=[1]),  # one Mamba 2 layer, one attention layer
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
    "codegen": dict(rotary_dim=8, n_ctx=512),
    "gptj": dict(rotary_dim=8),
    "zaya": dict(num_experts_per_tok=1),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], num_layers=2, window_size=8),
    "mpt": dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=512),
    "xglm": dict(d_model=64, ffn_dim=128, attention_heads=4, num_layers=2),
    "ctrl": dict(dff=128),
    "gemma4_text": dict(vocab_size_per_layer_input=1000, hidden_size_per_layer_input=16),
    "gemma4_unified_text": dict(vocab_size_per_layer_input=1000, hidden_size_per_layer_input=16),
    "inkling2_text": dict(unpadded_vocab_size=1000),
    "inkling2_loop_text": dict(unpadded_vocab_size=1000),
    "minimax_m3_vl_text": dict(dense_intermediate_size=128, shared_intermediate_size=32),
    "nemotron_h": dict(moe_shared_expert_intermediate_size=32),
    "deepseek_v4": dict(o_lora_rank=16, index_topk=8),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "zamba": dict(num_hidden_layers=4, layers_block_type=["linear_attention", "hybrid"] * 2, attention_hidden_size=128),
    "zamba2": dict(mamba_headdim=64, attention_hidden_size=128),  # attention reads [hidden, embeddings]
    "longcat_flash": dict(ffn_hidden_size=128, expert_ffn_hidden_size=32, zero_expert_num=2, moe_topk=2),
    "qwen4_exp_text": dict(
        indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16, indexer_compress_ratio=4
    ),
    "dory": dict(
        num_hidden_layers=3,
        n_input_layers=1,
        n_recurrent_layers=1,
        n_output_layers=1,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    "dots1": dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2),
    "glm_moe_dsa": dict(index_head_dim=16, index_n_heads=4, index_topk=8),
    "deepseek_v32": dict(index_head_dim=16, index_n_heads=4, index_topk=8),
    "axk2": dict(index_head_dim=16, index_n_heads=4, index_topk=8),
    "gemma3n_text": dict(num_kv_shared_layers=0, vocab_size_per_layer_input=1000, hidden_size_per_layer_input=16),
    "cohere_compass_text": dict(
        rope_parameters={
            kind: {"rope_type": "default", "rope_theta": 10000.0} for kind in ("full_attention", "sliding_attention")
        }
    ),
}
DROPOUT = ("dropout", "attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
           "hidden_dropout_prob", "attention_probs_dropout_prob", "ffn_dropout", "embed_dropout")  # fmt: skip
MAX_PARAMETERS = 10_000_000
LENGTHS = [9, 5, 12, 9]  # two of one length (one batched call), prompts masked


def decoder_families() -> list[str]:
    """The text-only decoder families of the installed transformers with a causal-LM head."""
    return sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - NOT_DECODERS)


def tiny_config(family: str) -> dict:
    """A random-init config of `family` small enough to run in a test, with every kind of layer it mixes."""
    defaults = AutoConfig.for_model(family).to_dict()
    cfg = {key: value for key, value in SMALL.items() if defaults.get(key) is not None}
    cfg.update({key: SMALL[key] for key in SIZES_OFTEN_NONE if key in defaults})  # None: derived from a large size
    cfg.update({key: 0.0 for key in DROPOUT if isinstance(defaults.get(key), float)})
    layers = 2
    for key in ("layer_types", "layers_block_type"):
        if isinstance(defaults.get(key), list) and defaults[key] and family != "nemotron_h":
            kinds = list(dict.fromkeys(defaults[key]))
            cfg[key] = kinds if len(kinds) > 1 else kinds * 2
            layers = len(cfg[key])
    if isinstance(defaults.get("block_types"), list):
        layers = len(defaults["block_types"])
    if isinstance(defaults.get("mlp_layer_types"), list) and defaults["mlp_layer_types"]:
        cfg["mlp_layer_types"] = (list(dict.fromkeys(defaults["mlp_layer_types"])) * layers)[:layers]
    if "attn_layer_period" in defaults:
        cfg.update(attn_layer_period=2, attn_layer_offset=1)
    if "expert_layer_period" in defaults:
        cfg.update(expert_layer_period=2, expert_layer_offset=1)
    if "hybrid_layer_ids" in defaults:
        cfg["hybrid_layer_ids"] = [1]
    if "full_attn_idxs" in defaults:
        cfg["full_attn_idxs"] = [1]
    if "qk_rope_head_dim" in defaults:  # multi-head latent attention: rotary over qk_rope_head_dim
        cfg["head_dim"] = SMALL["qk_rope_head_dim"]
    if "mamba_d_ssm" in defaults:
        cfg["mamba_d_ssm"] = None
    for key in ("num_hidden_layers", "num_blocks"):
        if key in defaults:
            cfg[key] = layers
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(defaults.get(key), int) and defaults[key] >= SMALL["vocab_size"]:
            cfg[key] = 1
    cfg.update(OVERRIDES.get(family, {}))
    return dict(model_type=family, **cfg)


@dataclass
class Row:
    family: str
    model: str = ""
    route: str = ""  # how its mixers are kept apart
    logits: float | None = None  # max |packed - per-example|
    loss: float | None = None
    grads: float | None = None  # max over parameters of max |packed - per-example| gradient
    refused: str = ""  # the one-line refusal, when it cannot be packed
    unbuilt: str = ""  # the tiny config does not build (not a packing result)


def measure(family: str, seed: int = 0) -> Row:
    row = Row(family)
    try:
        with torch.device("meta"):  # a family whose sizes the shrink missed is not built for real
            size = sum(
                p.numel()
                for p in AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_config(family))).parameters()
            )
        if size > MAX_PARAMETERS:
            row.unbuilt = f"ValueError: the tiny config still has {size / 1e6:.0f}M parameters"
            return row
        torch.manual_seed(seed)
        model, packing = load_causal_lm(model_config=tiny_config(family))
    except ConfigError as error:
        row.refused = str(error)
        return row
    except Exception as error:  # the shrunk config is invalid for this family, or cannot run one example alone
        row.unbuilt = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:120]}"
        return row
    row.model = type(model).__name__
    keywords = packing.keywords
    mixers = find_mixers(model)
    kinds = sorted({type(m).__name__ for _, m in mixers})
    extras = sorted(keywords & {"s_aux", "sinks", "position_bias"})
    ways = ["attention" + (f" (+ {', '.join(extras)})" if extras else "")] if keywords else []  # it was called
    if kinds:
        ways.append(f"per-example {', '.join(kinds)}")
    row.route = "; ".join(ways)
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(seed)
    examples = []
    for n in LENGTHS:
        ids = torch.randint(3, min(vocab, 1000), (n,), generator=gen).tolist()
        examples.append({"input_ids": ids, "labels": [-100] * (n // 3) + ids[n // 3 :]})
    model.eval()  # no dropout; gradients still flow
    ref_logits, ref_loss, ref_grads = per_example_reference(model, examples)
    batch = PackedCollator()(examples)
    keys = ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    logits = model(**{k: batch[k] for k in keys}, use_cache=False).logits
    losses, mask, _ = token_losses(logits, batch["labels"])
    loss = losses.sum() / mask.sum()
    loss.backward()
    row.logits = float((logits[0].detach() - ref_logits).abs().max())
    row.loss = abs(float(loss) - float(ref_loss))
    row.grads = max(
        float((p.grad - ref_grads[n]).abs().max()) for n, p in model.named_parameters() if p.grad is not None
    )
    return row
