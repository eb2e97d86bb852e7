"""engine/: the reference Engine, ModelRunner and LLM."""
