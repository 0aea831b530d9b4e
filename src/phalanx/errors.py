"""The one exception type users see.

A :class:`PhalanxError` is bad input or a broken environment that the user can fix. Its message
is one line that names the problem and the fix; the CLI prints it without a traceback and exits
with status 2. Anything else that escapes is a bug in phalanx (or in the user's model) and keeps
its traceback.
"""


class PhalanxError(Exception):
    """Bad input or environment, with a message that names the fix."""

    exit_code = 2


class TrainingDiverged(PhalanxError):
    """The loss became NaN or infinite; training stopped before saving a bad checkpoint."""

    exit_code = 1


class WorkerFailed(PhalanxError):
    """A worker process died or raised; the job was brought down."""

    exit_code = 1

    def __init__(self, rank: int, detail: str, who: str = "", step: "int | None" = None):
        self.rank = rank
        self.detail = detail
        self.who = who or f"worker {rank}"
        self.step = step  # the last step this rank reported, where known
        super().__init__(f"{self.who} failed: {detail}")


class PeerLost(PhalanxError):
    """A collective failed because another rank went away (its process or its node died): this rank ends
    with this one line (exit 1, which a torchrun agent restarts), never a traceback or an abort."""

    exit_code = 1


class StorageError(PhalanxError):
    """A checkpoint could not be written (disk full, permission denied); nothing saved before was lost."""

    exit_code = 1


class JobHung(PhalanxError):
    """No rank the job needs made progress for --hang-timeout seconds; the report names who is stuck where."""

    exit_code = 1


class Stopped(PhalanxError):
    """The job was asked to stop (SIGTERM, SIGINT): every worker stopped at one step, a checkpoint was saved."""

    def __init__(self, message: str, signame: str = "SIGTERM", summary: object = None):
        import signal

        super().__init__(message)
        self.signame = signame
        self.summary = summary
        self.exit_code = 128 + int(getattr(signal, signame, signal.SIGTERM))
