"""Pipeline parallelism: cutting the model into cost-balanced chunks and running the
schedule over this rank's stages (``runtime.py``), the schedules' facts shared with the
planner (``schedules.py``: chunks per rank, bubble), the stages' auxiliary losses
(``stage_aux.py``); the layout rules are ``parallel/pipeline/rules.py``."""
