"""Run health: non-finite values, loss spikes, hangs and stragglers, found and named.

``guard.py`` is the step guard the step runner asks before each update; ``nonfinite.py``
finds where a non-finite value came from; ``spike.py`` is the robust loss-spike test;
``watchdog.py`` and ``hang_report.py`` catch a rank stuck in (or before) a collective;
``straggler.py`` names slow ranks; ``text_check.py`` warns about input that is not text.
See docs/health.md.
"""
