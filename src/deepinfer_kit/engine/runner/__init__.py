"""engine/runner/: the in-process device side of an engine — model, KV pool, sampler,
round layout, static decode, warm-up, drafting and EPLB glue; ``build_device`` makes it."""
