"""Triton kernels, each beside a plain-torch reference of the same function.

Modules:
- router:          MoE routing (softmax, top-k, renorm, cast; the router GEMM too at decode sizes) in one launch
- moe_align:       token->expert grouping padded to the block size (device-side, static sizes)
- fused_moe:       grouped-GEMM MoE (gate_up, fused SiLU*up, down, routed top-k sum) + MoE-LoRA
- lora_dense:      multi-LoRA shrink/expand for dense projections, on rows grouped by adapter slot
- paged_attention: paged decode (split-K) and varlen prefill attention over the block cache
- moe_lora:        expert-LoRA shrinks (per pair at decode, per expert block when sorted) and the expands the
                   fused-MoE GEMM epilogues run
- gemv:            dense projections at one or two rows, the dense-LoRA expand in its epilogue
- norm_rotary:     residual add + RMSNorm; q/k norm + rotary + KV-cache write
- pdl:             programmatic dependent launch (Hopper): every kernel above waits for its predecessor in-kernel
"""
