"""Names vulture reports as unused that an interface requires (read by tests/unit/test_structure.py)."""

# signal handlers take (signum, frame); torch's optimizer API names its arguments
_.signum  # noqa: F821, B018
_.frame  # noqa: F821, B018
_.closure  # noqa: F821, B018
_.set_to_none  # noqa: F821, B018
_.async_op  # noqa: F821, B018
_.example_inputs  # noqa: F821, B018
