"""What a run shows and writes: log lines, metrics, loss curve, summary and MFU (``report``),
and ``--profile-steps`` traces (``profiling``).

May import: config, models, runtime.
"""
