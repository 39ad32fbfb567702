"""Model facts: ModelSpec from config.json, Checkpoint from safetensors headers, tiny models."""
