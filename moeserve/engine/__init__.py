"""The engine core: scheduler, LoRA manager, start-up warm-up, and the process that runs them."""
