"""Benchmarks of flashtile against PyTorch's attention kernels: ``python -m flashtile.bench``.

One module per subcommand, each with ``main(argv)`` (``speed``, ``memory``, ``report``,
``variants``, ``decode``); ``common`` holds inputs, implementations, modes, timers, records and
argument parsers, ``render`` the tables and plots. ``__main__`` dispatches the subcommands.
"""
