"""Tokenizers, corpus preparation into token shards, and the resumable sampler."""
