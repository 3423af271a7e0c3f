"""Shard engines: the ShardEngine contract, a fault-injecting fake, and the llama.cpp layer-range engine."""
