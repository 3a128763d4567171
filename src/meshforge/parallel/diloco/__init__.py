"""DiLoCo and Streaming DiLoCo across islands of ranks: the outer optimizer, fragments synced
at staggered steps, the pseudo-gradient wire formats (``outer.py``); the layout rules are
``parallel/diloco/rules.py``."""
