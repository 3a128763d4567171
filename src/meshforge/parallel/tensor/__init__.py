"""Tensor parallelism with sequence parallelism (Megatron column/row splits on DTensor,
vocab-parallel embedding and loss-parallel head): ``apply.py``; an MoE block under tp
(the router replicated, each tp rank dispatching its share of the slots): ``moe.py``; the
layout rules are ``parallel/tensor/rules.py``."""
