"""Context parallelism: exact ring attention over the cp ranks (``ring.py``: zigzag or
contiguous split, ring or all-gather K/V rotation), the attention kernels of one ring block
(``kernels.py``), MoE balance counts over the whole sequence (``moe.py``) and the ring's cost
formulas shared with the planner (``cost.py``); the layout rules are
``parallel/context/rules.py``."""
