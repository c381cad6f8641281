"""Model-level benchmark suites of the trainer: ``lab2-train bench SUITE``.

Suites (each a module with ``run(args, out)``; its one-line help and options are in
:mod:`.arguments`, which imports no torch): ``e2e``, ``precision``, ``compile``, ``norm``,
``memory`` on one device; ``ddp``, ``zero`` and ``stack`` on N local ranks spawned by
:mod:`.launcher`. They measure with lab2bench and write through ``lab2bench.SuiteOutput``
(JSONL, Markdown, PNG).
:mod:`.cli` makes each a lab2bench ``Suite``, declared as an entry point of the group
``lab2bench.suites`` (``lab2bench train-<suite>`` runs it too).
"""
