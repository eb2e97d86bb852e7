"""models/parallel/: tensor parallelism as layer kinds (column- and row-parallel linears, a
vocab-parallel embedding and LM head), each rank loading only its shard of a checkpoint."""

from deepinfer_kit.models.parallel.shard import AttentionShard, VocabShard, attention_shard, split_even, vocab_shard

__all__ = ["AttentionShard", "VocabShard", "attention_shard", "split_even", "vocab_shard"]
