"""LoRA adapters: PEFT-format parsing and validation (adapter.py), host cache and device slot pool."""
