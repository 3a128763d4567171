"""What refuses a run before it writes anything, and what keeps it from writing where it
should not: the pre-flight checks (``preflight.py``: config, run directory, data, memory fit,
disk), the memory fit (``memory_fit.py``, ``guards/host_limits.py``), the disk (``guards/disk.py``), output
paths (``guards/out_paths.py``), files meshforge did not write (``foreign_files.py``) and the run
directory's lock (``guards/run_lock.py``)."""
