"""Data parallelism: DDP, ZeRO-1 (ZeroRedundancyOptimizer in fp32, FlatZero1 in bf16), ZeRO-2/3
and HSDP on FSDP2. ``apply.py`` wraps the model and builds the sharded optimizer, ``zero1.py``
is bf16 ZeRO-1's own optimizer and its reduce-scatter/all-gather; the layout rules are
``parallel/data/rules.py``."""
