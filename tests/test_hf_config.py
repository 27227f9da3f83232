"""Reading HF config.json files (no torch): layouts, and refusals of what lcx does not implement."""

from __future__ import annotations

import json

import pytest

from lcx.config import ConfigError
from lcx.hf import config_from_hf, config_to_hf, load_hf, read_hf_config

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
         "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
         "num_key_value_heads": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "torch_dtype": "float16", "hidden_act": "silu"}


def test_hf_config_legacy_llama2():
    cfg = config_from_hf(LLAMA)
    assert (cfg.d_model, cfg.n_layers, cfg.head_dim, cfg.param_dtype) == (4096, 32, 128, "float16")
    assert cfg.rope.type == "default" and not cfg.qkv_bias and cfg.num_params() == 6_738_415_616


def test_hf_config_llama31_rope_scaling():
    hf = dict(LLAMA, rope_theta=500000.0, num_key_value_heads=8, max_position_embeddings=131072,
              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192})
    cfg = config_from_hf(hf)
    assert cfg.rope.type == "llama3" and cfg.rope.theta == 500000.0 and cfg.original_max_position_embeddings == 8192


def test_hf_config_qwen2_has_qkv_bias_only():
    hf = dict(LLAMA, architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False,
              sliding_window=4096, num_key_value_heads=4, torch_dtype="bfloat16")
    cfg = config_from_hf(hf)
    assert cfg.qkv_bias and not cfg.o_bias and cfg.param_dtype == "bfloat16"
    assert config_to_hf(cfg)["architectures"] == ["Qwen2ForCausalLM"]


def test_hf_config_layer_types_from_legacy_keys():
    """Configs written before ``layer_types`` existed: Mistral's window covers every layer, Gemma 3's pattern puts
    one global layer after five local ones (local RoPE base from ``rope_local_base_freq``), Qwen's windows start at
    ``max_window_layers``."""
    mistral = config_from_hf(dict(LLAMA, architectures=["MistralForCausalLM"], model_type="mistral",
                                  sliding_window=4096))
    assert mistral.family == "mistral" and set(mistral.types) == {"sliding_attention"}
    assert mistral.attention_specs()[0].window == 4096
    gemma3 = config_from_hf(dict(LLAMA, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                                 num_hidden_layers=12, sliding_window=512, sliding_window_pattern=6,
                                 rope_theta=1e6, rope_local_base_freq=10000.0, query_pre_attn_scalar=256,
                                 hidden_activation="gelu_pytorch_tanh", head_dim=256))
    assert [t[0] for t in gemma3.types] == list("sssssfsssssf")
    specs, index = gemma3.spec_table()
    assert len(specs) == 2 and index == (0,) * 5 + (1,) + (0,) * 5 + (1,)
    assert specs[0].rope.theta == 10000.0 and specs[1].rope.theta == 1e6 and specs[0].sm_scale == 256 ** -0.5
    qwen = config_from_hf(dict(LLAMA, architectures=["Qwen2ForCausalLM"], model_type="qwen2", num_hidden_layers=4,
                               use_sliding_window=True, sliding_window=64, max_window_layers=2))
    assert qwen.types == ("full_attention",) * 2 + ("sliding_attention",) * 2
    assert config_from_hf(config_to_hf(gemma3)) == gemma3 and config_from_hf(config_to_hf(qwen)) == qwen


@pytest.mark.parametrize("changes, message", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "architectures=['GPT2LMHeadModel']"),
    ({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_activation": "gelu"},
     "hidden_activation='gelu' is not supported"),
    ({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "use_bidirectional_attention": True},
     "use_bidirectional_attention=true"),
    ({"layer_types": ["full_attention"] * 31 + ["chunked_attention"], "sliding_window": 64},
     "model.layer_types[31]='chunked_attention'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}, "local": {"rope_type": "default"}}},
     "rope_parameters has per-layer-type entries ['local']"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    # a window on a family with no window rule was dropped (full attention where the checkpoint states a window)
    ({"sliding_window": 4096}, "sliding_window=4096 is not supported for llama"),
    ({"mlp_bias": True}, "mlp_bias=true is not supported"),
    ({"rope_scaling": {"type": "su", "factor": 2.0}}, "rope_type='su' is not supported"),
    ({"rope_scaling": {"rope_type": "linear"}}, "rope.factor is required for rope.type='linear'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "magic": 1}}, "rope parameter 'magic'=1"),
    ({"num_key_value_heads": 5}, "model.n_heads=32 is invalid: must be a multiple of model.n_kv_heads=5"),
    ({"torch_dtype": "int8"}, "dtype='int8' is not a dtype lcx supports"),
])
def test_hf_config_refuses_unsupported(changes, message):
    with pytest.raises(ConfigError) as err:
        config_from_hf(dict(LLAMA, **changes))
    assert message in str(err.value)


def test_hf_dir_errors(tmp_path):
    with pytest.raises(ConfigError, match="is not a Hugging Face checkpoint directory"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        read_hf_config(tmp_path)
    small = dict(LLAMA, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=10)
    (tmp_path / "config.json").write_text(json.dumps(small))
    with pytest.raises(ConfigError, match="holds no model.safetensors"):
        load_hf(tmp_path)


def test_hf_missing_and_misshapen_tensors(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    small = dict(LLAMA, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=10, torch_dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps(small))
    save_file({"model.embed_tokens.weight": np.zeros((10, 16), np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="tensor 'model.layers.0.self_attn.q_proj.weight' is missing"):
        load_hf(tmp_path)
    save_file({"model.embed_tokens.weight": np.zeros((10, 16), np.float32),
               "model.layers.0.self_attn.q_proj.weight": np.zeros((8, 16), np.float32)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"has shape \(8, 16\), the config implies \(16, 16\)"):
        load_hf(tmp_path)
