"""The run's processes, files and clock: the launch (``launch``) and supervision
(``supervise``) of the ranks, rank 0's work alone at the end (``rank0_alone``), the run folder
and its atomic writes (``run_folder``), checks of input and output paths (``paths``), and
where the wall clock goes (``wall_clock``).

May import: config.
"""
