"""LoRA adapters: their names (names.py), PEFT-format parsing and validation (adapter.py, pattern_keys.py) and the
device slot pool (slot_pool.py). The engine core's adapter registry and host cache is engine/lora_manager.py."""
