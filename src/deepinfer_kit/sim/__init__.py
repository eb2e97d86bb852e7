"""sim/: cost-model runner and virtual clock driving the real components."""
