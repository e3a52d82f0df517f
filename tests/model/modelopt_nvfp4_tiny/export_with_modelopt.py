"""How this directory was made: a tiny random DeepSeek-V3 quantized with NVIDIA ModelOpt's NVFP4 recipe and
exported on the CPU (nvidia-modelopt 0.47.0, transformers 5.25.0), attention left in bf16 as
nvidia/DeepSeek-R1-FP4 keeps it (generation_config.json not kept). Needs nvidia-modelopt:
``python tests/model/modelopt_nvfp4_tiny/export_with_modelopt.py OUT_DIR``."""

import sys

import modelopt.torch.quantization as mtq
import torch
from modelopt.torch.export import export_hf_checkpoint
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

cfg = DeepseekV3Config(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
    n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=16, v_head_dim=16, max_position_embeddings=128, architectures=["DeepseekV3ForCausalLM"],
)
torch.manual_seed(0)
model = DeepseekV3ForCausalLM(cfg).to(torch.bfloat16).eval()
recipe = mtq.NVFP4_DEFAULT_CFG
quant_cfg = {**recipe, "quant_cfg": [*recipe["quant_cfg"], {"quantizer_name": "*self_attn*", "enable": False}]}
batch = torch.randint(0, cfg.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))
model = mtq.quantize(model, quant_cfg, lambda m: m(batch))
export_hf_checkpoint(model, export_dir=sys.argv[1])
