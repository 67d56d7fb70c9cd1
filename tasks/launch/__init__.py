"""Launching a stage's trainer on this machine and telling why it failed.

- :mod:`~tasks.launch.process`: the trainer as a child process (``python``, ``torchrun`` or the
  ``deepspeed`` launcher) in its own process group, its output streamed, never leaked.
- :mod:`~tasks.launch.commands`: the command lines that run a stage on a backend's ranks.
- :mod:`~tasks.launch.aborts`: how an interrupted flow stops what its task threads launched.
- :mod:`~tasks.launch.failures`: the errors a failed launch raises (bad input, resources, a
  crash) and torchrun's failure summary.
"""
