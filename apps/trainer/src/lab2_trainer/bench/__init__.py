"""Model-level benchmark suites of the trainer: ``lab2-train bench SUITE``.

Suites (each a module with ``NAME``, ``HELP``, ``add_arguments(parser)`` and
``run(args, out)``): ``e2e``, ``precision``, ``compile``, ``norm``, ``memory`` on one device;
``ddp``, ``zero`` and ``stack`` on N local ranks spawned by :mod:`.launcher`. They measure
with lab2bench and write through :class:`.report.SuiteOutput` (JSONL, Markdown, PNG).
"""
