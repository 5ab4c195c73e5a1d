"""Triton kernels, each beside a plain-torch reference of the same function.

Modules:
- router:          MoE routing (softmax, top-k, renorm, cast; the router GEMM too at decode sizes) in one launch
- moe_align:       token->expert grouping padded to the block size (device-side, static sizes)
- fused_moe:       grouped-GEMM MoE (gate_up, fused SiLU*up, down, routed top-k sum) + MoE-LoRA
- lora_dense:      multi-LoRA shrink/expand for dense projections, gathered by adapter slot
- paged_attention: paged decode (split-K) and varlen prefill attention over the block cache
"""
