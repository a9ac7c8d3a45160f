"""LoRA adapters: reading PEFT folders, the loaded set, each step's LoRA rows."""
