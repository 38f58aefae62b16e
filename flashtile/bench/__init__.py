"""Benchmarks of flashtile against PyTorch's attention kernels: ``python -m flashtile.bench``.

One module per subcommand, each with ``main(argv)`` (``speed`` with the CPU engine benchmark
``cpu``, ``memory``, ``report``, ``variants``, ``decode``, ``train``, ``io``, ``cp``); ``common``
holds inputs, implementations, modes, timers, records, argument parsers and the results files
(``benchmarks/results/<device>.json``, one entry per benchmark), ``report`` the tables and plots.
``__main__`` dispatches the subcommands.
"""
