"""GGUF import (llama.cpp's model file) without torch: ``load_gguf(path) -> (ModelConfig, params)``, the tokenizer
from the file's metadata (``read_gguf_tokenizer``), and through ``lcx convert`` a Hugging Face directory.

Supported:

- ``general.architecture`` llama, mistral, qwen2 and qwen3: the dense, full-attention SwiGLU blocks lcx runs (qwen2
  with q/k/v biases; qwen3 with QK-norm; llama/mistral/qwen3 with all four attention biases or none). Tied embeddings
  = no ``output.weight``.
- gemma2 and gemma3 (text): llama.cpp's file leaves part of the model out of the metadata and its loader fills it
  in by rule; lcx applies the same rules (``GEMMA_RULES``): the layer pattern (Gemma 2: every 2nd layer global,
  the first local; Gemma 3: every 6th, or ``{arch}.attention.sliding_window_pattern`` when a file states it), the
  query scale (``query_pre_attn_scalar``: hidden / heads for the 27B models - 46 and 62 layers - else the head
  dim), Gemma 3's local RoPE base (10,000, unscaled; the global layers take ``rope.freq_base`` and its scaling),
  and Gemma 2's soft-caps (``attn_logit_softcapping`` / ``final_logit_softcapping``, 50 and 30 when absent). The
  converter stores every Gemma RMSNorm weight as ``1 + w`` (the scale the model multiplies by); the reader
  subtracts the 1. Their ``ffn_norm`` is the pre-MLP norm (``pre_feedforward_layernorm``), ``post_attention_norm``
  and ``post_ffw_norm`` the sandwich norms.
- RoPE: default, linear and YaRN (``{arch}.rope.scaling.*``), and Llama 3.x scaling, which llama.cpp stores as a
  ``rope_freqs.weight`` tensor of per-frequency factors: lcx recovers the llama3 parameters from it and refuses
  factors of any other form.
- Tensor types (``TENSOR_TYPES``): F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q2_K..Q6_K,
  dequantized by the ``gguf`` package into float32, or into ``dtype``.
- Tokenizers (``tokenizer.ggml.model``): ``gpt2`` (byte-level BPE from tokens + merges, the pre-tokenizer named by
  ``tokenizer.ggml.pre``, see ``PRE_TOKENIZERS``) and ``llama`` (SentencePiece BPE with byte fallback from tokens +
  scores), built with the ``tokenizers`` package.

Anything else - another architecture, sliding-window attention or soft-capping outside Gemma, experts, partial
rotary, an i-quant, an unknown tensor - is refused by name rather than loaded wrong.

How: the metadata becomes a Hugging Face ``config.json`` dict, so ``lcx.checkpoints.hf_config.config_from_hf`` builds
and validates the ``ModelConfig`` exactly as for a HF directory, and ``GGUFTensorReader`` serves the tensors under
their HF names in HF layout, so ``lcx.model.families.assemble`` does the reshapes - the same two steps as
``lcx.checkpoints.hf``, which takes nothing from this package but ``load_gguf`` (re-exported beside ``load_hf``).
llama.cpp's converter permutes the rows of llama/mistral q and k per head (from the half-split RoPE layout to the
interleaved pairs its kernel rotates); the reader undoes it. qwen2 / qwen3 files are written unpermuted (llama.cpp
runs them with the half-split "NEOX" rotation).
"""

from lcx.checkpoints.gguf.config import hf_config
from lcx.checkpoints.gguf.file import ARCHITECTURES, GEMMA_RULES, TENSOR_TYPES, GGUFFile
from lcx.checkpoints.gguf.tensors import (GGUFTensorReader, assemble, load_gguf, read_gguf, read_gguf_config,
                                         read_gguf_params)
from lcx.checkpoints.gguf.tokenizer import PRE_TOKENIZERS, GGUFTokenizer, read_gguf_tokenizer, tokenizer_from_metadata

__all__ = ["ARCHITECTURES", "GEMMA_RULES", "GGUFFile", "GGUFTensorReader", "GGUFTokenizer", "PRE_TOKENIZERS",
           "TENSOR_TYPES", "assemble", "hf_config", "load_gguf", "read_gguf", "read_gguf_config", "read_gguf_params",
           "read_gguf_tokenizer", "tokenizer_from_metadata"]
