"""Expert parallelism: each MoE layer's experts split over ep data-parallel ranks, tokens
dispatched and combined by all-to-all, the experts' FSDP units over the remaining ranks
(``dispatch.py``); the layout rules are ``parallel/expert/rules.py``."""
