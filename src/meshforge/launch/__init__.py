"""Starting ranks: the launcher's environment (``env.py``), the local multi-process start
through torch.distributed.run (``local.py``), ranks tied to their launcher (``tie.py``) and
the garbage collector paused while a rank starts (``launch/startup_gc.py``)."""
