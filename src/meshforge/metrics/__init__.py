"""MFU/HFU, logging sinks (console, JSONL, TensorBoard)."""
