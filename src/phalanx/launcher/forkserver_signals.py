"""Imported by a fork server alone, first of its preloads: the server ignores the stop signals (SIGTERM,
SIGHUP; multiprocessing's server ignores SIGINT itself), and a process forked from it records one that arrives
before its own handlers are installed (:func:`phalanx.launcher.stop_signals.guard_fork_server`).

A stop sent to the whole process group (``kill -TERM -PGID``; Slurm and Kubernetes stop a job that way; a
closed terminal sends SIGHUP) reaches the fork server too. Left to the default it died there, and
multiprocessing reports every child of a dead fork server as exited with status 255 (it reads their statuses
from the server): the launcher took the job for failed before its first step while the workers, alive,
stopped at a step and saved it, then lost the store under them (C++ traces). The server still ends with the
process that started it (it reads EOF on a pipe from that process), and is ended by SIGKILL where phalanx
stops it.

Its children inherit the handler, not SIG_IGN: a phalanx worker signalled the moment it appears, before
:meth:`phalanx.launcher.watch.Progress.handle_signals`, ends at once with 128 + the signal as soon as that
runs (it has nothing to save), where an ignored SIGTERM was lost and a SIGINT raised a KeyboardInterrupt
anywhere in its start-up. A DataLoader worker (forked by its rank's own loader fork server, which preloads
this module too) records and otherwise ignores a stop, as it must: killed by the group's SIGTERM it would fail
its rank's next batch before the rank could stop and save; its rank ends it (an end-of-data message, and its
watchdog sees the rank exit).
"""

from phalanx.launcher.stop_signals import guard_fork_server

guard_fork_server()
