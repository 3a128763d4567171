"""The command line: ``main.py`` parses and dispatches every command, ``train.py`` is
``meshforge train`` (its arguments, the launch, the run report)."""
