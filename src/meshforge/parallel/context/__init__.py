"""Context parallelism: exact ring attention over the cp ranks (``ring.py``: zigzag or
contiguous split, ring or all-gather K/V rotation), the attention kernels of one ring block
(``kernels.py``), packed documents on the ring (``document_ring.py``), MoE balance counts over
the whole sequence (``moe.py``) and the layout rules (``rules.py``); the ring's cost formulas
are the planner's (``planner/context_costs.py``)."""
