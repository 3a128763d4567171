"""Fault tolerance across replica groups (torchft): rules.py (what composes), replicas.py (the manager, the
gradient average, the commit), heal.py (the state a joining group takes from a live peer), lighthouse.py."""
