"""The planner: for a model and a cluster, the layouts that fit, ranked by predicted speed."""
