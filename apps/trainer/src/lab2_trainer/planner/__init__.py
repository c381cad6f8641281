"""The planner: predicted memory per GPU and step time of a run, from arithmetic on its shape
(``plan``); no torch. ``lab2-train plan`` is :mod:`lab2_trainer.cli.plan`.

May import: config, models, recipe.
"""
