"""lab2sys: the file and process safety a training run needs, standard library only.

Modules: :mod:`lab2sys.files` (atomic writes that never replace anything but a regular
file, temporary names that fit the file system's limit) and :mod:`lab2sys.processes`
(threads per CPU rank, the parent-death signal, a pid's start time, owner records and the
sweep of folders whose owner died). ``import lab2sys`` imports neither module.
"""

__version__ = "0.1.0"
