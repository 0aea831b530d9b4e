"""Imported by a fork server alone, first of its preloads: the server ignores SIGTERM, as it ignores SIGINT.

A stop sent to the whole process group (``kill -TERM -PGID``; Slurm and Kubernetes stop a job that
way) reaches the fork server too. Left to the default it died there, and multiprocessing reports
every child of a dead fork server as exited with status 255 (it reads their statuses from the
server): the launcher took the job for failed before its first step while the workers, alive,
stopped at a step and saved it, then lost the store under them (C++ traces). Python's own fork
server ignores SIGINT for the same reason (a terminal's Ctrl-C), and multiprocessing's resource
tracker ignores both. The server still ends with the process that started it (it reads EOF on
a pipe from that process), and is ended by SIGKILL where phalanx stops it.

Its children inherit the disposition. A phalanx worker installs its own SIGTERM handler first thing
(:meth:`phalanx.launcher.watch.Progress.handle_signals`: stop at a step and save). A DataLoader worker (forked
by its rank's own loader fork server, which preloads this module too) keeps ignoring it, as it must:
killed by the group's SIGTERM it would fail its rank's next batch before the rank could stop and
save; its rank ends it (an end-of-data message, and its watchdog sees the rank exit).
"""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
