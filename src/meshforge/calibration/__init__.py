"""`meshforge calibrate`: measure this machine into a hardware profile (planner/hardware.py reads it)."""
