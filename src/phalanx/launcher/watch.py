"""Who is where: every rank's progress through the rendezvous store, watched for hangs and stops.

Worker side, :class:`Progress`: the training loop marks ``at(step, phase)`` (attribute writes, free
on the hot path); a daemon thread publishes that four times a second under ``progress/<rank>`` with a
heartbeat, and, when the parent asks, a *dump*: torch's flight recorder's view of this rank's
collectives (gloo records them in torch 2.13: the newest one not yet retired is the one it waits
in) and its main thread's Python stack. A process that is stopped (SIGSTOP) or frozen publishes
nothing, so its heartbeat goes stale; one that is busy keeps beating on the same step.

Parent side, :class:`Watcher`: reads every rank's progress; when no rank the job cannot lose has
moved for ``hang_timeout`` seconds, it asks for dumps and writes a report that names the stuck
rank and where it is (:mod:`.hang_report`), e.g.::

    rank 1 is stuck in step 37, in the training step, not in a collective (process stopped or frozen:
    no heartbeat for 64 s); ranks 0 and 2 wait in gloo:all_reduce (collective 74) of step 37

Stop requests (SIGTERM, SIGINT, SIGHUP) reach each worker as a signal; :meth:`Progress.stop_requested`
holds the signal's name for the loop, which stops at a step boundary every rank agrees on.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional, overload

import torch.distributed as dist

from ..errors import Stopped
from .hang_report import RankState, describe_hang
from .stop_signals import STOP_SIGNALS, taken_early

PREFIX = "phalanx/"
#: How long workers may take to start (spawn, import torch, rendezvous) before a silent one is a hang.
STARTUP_S = 120.0
#: Signals that reach a worker within this many seconds of the first are one request, not a second.
SAME_REQUEST_S = 1.0
#: Entries torch's flight recorder keeps per rank (it must be set before the process group starts).
FLIGHT_RECORDER_ENTRIES = "64"


def enable_flight_recorder() -> None:
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES)


@overload
def launcher_view(store: dist.Store) -> dist.Store: ...
@overload
def launcher_view(store: None) -> None: ...
def launcher_view(store: Optional[dist.Store]) -> Optional[dist.Store]:
    """The job's store as the launcher keeps its records in it (under ``PREFIX``): progress, hang dumps, who
    left and who is gone (:func:`say_gone`)."""
    return None if store is None else dist.PrefixStore(PREFIX, store)


def store_client(addr: str, port: int, timeout_s: float = 30.0) -> dist.Store:
    """A connection of its own to the job's store (the watch thread never shares the main thread's)."""
    return launcher_view(dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s)))


def say_raised(store: Optional[dist.Store], rank: int) -> None:
    """Record in the job's store that ``rank`` raised an exception, before its connections close: a peer
    that sees it go can tell a bug (which every worker may share: end the job with its traceback) from a
    lost machine (go on without it). A round trip (``add``), so the record is there before the connections
    close."""
    if store is None:
        return
    try:
        store.add(f"{PREFIX}raised/{rank}", 1)
    except Exception:  # the store is gone: the job is ending anyway
        pass


def has_raised(store: Optional[dist.Store], rank: int) -> bool:
    """Whether ``rank`` recorded that it raised (see :func:`say_raised`)."""
    try:
        return store is not None and store.check([f"{PREFIX}raised/{rank}"])
    except Exception:
        return False


def say_gone(store: Optional[dist.Store], rank: int) -> None:
    """Record in the job's store (``store``: its :func:`launcher_view`) that ``rank`` will not leave with the
    others: it died, or its
    server dropped it as frozen. Counted once in ``gone``, whoever sees it first (the parent, the server), so
    the ranks that leave together (``launcher/local.py``) and the parent waiting for them need not wait for it."""
    if store is None:
        return
    try:
        if store.add(f"gone/{rank}", 1) == 1:
            store.add("gone", 1)
    except Exception:  # the store is gone: the job is ending anyway
        pass


def is_gone(store: dist.Store, rank: int) -> bool:
    """Whether ``rank`` was recorded gone (see :func:`say_gone`)."""
    try:
        return store.check([f"gone/{rank}"])
    except Exception:
        return False


# --------------------------------------------------------------------------- worker side


class Progress:
    """This rank's place in the run, published four times a second and at once as it starts and as its first
    step begins; stop requests turned into a flag."""

    def __init__(self, rank: int, interval_s: float = 0.25):
        self.rank, self.interval_s = rank, interval_s
        self.store: Optional[dist.Store] = None
        self.step, self.phase = 0, "starting"
        self.moved = time.time()
        self.stop_requested: Optional[str] = None  #: the name of the signal that asked this rank to stop
        self._requested_at = 0.0
        self._answered_dump = ""
        self.cpu_seconds = 0.0  #: CPU time this rank's watch thread has used (its whole cost)
        self._closing = threading.Event()
        self._wake = threading.Event()  #: publish now: at the start, the first step, the end
        self._wake.set()
        self._thread: Optional[threading.Thread] = None

    def publish(self, store: dist.Store) -> "Progress":
        """Start publishing to ``store``, a connection of this thread's own."""
        self.store = store
        self._thread = threading.Thread(target=self._beat, args=(store,), name="phalanx-progress", daemon=True)
        self._thread.start()
        return self

    def at(self, step: int, phase: str) -> None:
        if step != self.step or phase != self.phase:
            if self.step == 0:  # the first step begins: said at once, not a beat later (see Watcher.hung)
                self._wake.set()
            self.step, self.phase, self.moved = step, phase, time.time()

    def request_stop(self, name: str) -> None:
        """Ask this rank to stop at the next step boundary; asked twice, stop now."""
        if self.stop_requested is not None:
            raise Stopped(f"stopped at once by a second {name}; checkpoints are written atomically, so the newest "
                          "one in the checkpoint directory is whole", name)
        self.stop_requested = name

    def handle_signals(self) -> None:
        """In a worker process: SIGTERM, SIGINT and SIGHUP ask for a stop at the next step boundary (no
        KeyboardInterrupt traceback); a second one, or one before training began, ends the process at once,
        as does one that reached it before this ran (:func:`~phalanx.launcher.stop_signals.taken_early`).

        Signals within :data:`SAME_REQUEST_S` of the first are the same request: a terminal's Ctrl-C
        reaches every process of its group, and the launcher (phalanx's parent, torchrun's agent)
        passes its own copy on, so one Ctrl-C reaches a worker twice.
        """
        def stop(signum: int, frame: Any) -> None:
            now = time.monotonic()
            if self.stop_requested is not None and now - self._requested_at < SAME_REQUEST_S:
                return
            if self.stop_requested is not None or self.step == 0:
                # At once: a second request, or one before the first step (blocked in start-up, with
                # nothing to save, waiting would only make the launcher wait too). Checkpoints are atomic.
                os._exit(128 + signum)
            self.stop_requested, self._requested_at = signal.Signals(signum).name, now

        if threading.current_thread() is threading.main_thread():  # (signals belong to the main thread)
            for sig in STOP_SIGNALS:
                signal.signal(sig, stop)
            early = taken_early()
            if early is not None and self.stop_requested is None:
                stop(early, None)

    def _beat(self, store: dist.Store) -> None:
        while True:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._closing.is_set():
                break
            try:
                self._publish(store)
                self._answer_dump(store)
            except Exception:  # the store is gone: the job is ending
                return
            finally:
                self.cpu_seconds = time.thread_time()
        # A last beat on the way out: when a peer dies, this rank fails out of its collective at once,
        # and the parent names the step of the death from the freshest heartbeat (a beat is a quarter
        # second, hundreds of steps in a fast job).
        try:
            self._publish(store)
        except Exception:
            pass

    def _publish(self, store: dist.Store) -> None:
        store.set(f"progress/{self.rank}", json.dumps(
            {"step": self.step, "phase": self.phase, "moved": self.moved, "beat": time.time(), "pid": os.getpid()}))

    def _answer_dump(self, store: dist.Store) -> None:
        if not store.check(["dump"]):
            return
        request = store.get("dump").decode()
        if request == self._answered_dump:
            return
        self._answered_dump = request
        store.set(f"dump/{self.rank}", json.dumps({"collectives": flight_recorder_view(),
                                                        "stack": main_thread_stack()}))

    def close(self) -> None:
        self._closing.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(2 * self.interval_s)


def flight_recorder_view() -> dict[str, Any]:
    """This rank's newest collective per process group, from torch's flight recorder."""
    try:
        import torch._C._distributed_c10d as c10d

        # private, so absent from torch's stubs
        entries = json.loads(c10d._dump_fr_trace_json(True, True)).get("entries", [])  # type: ignore[attr-defined]
    except Exception as e:  # an older torch, or no process group
        return {"error": str(e)[:120]}
    newest: dict[str, dict] = {}
    for entry in entries:
        group = ",".join(map(str, entry.get("process_group", ["?"])))
        seq = entry.get("p2p_seq_id") if entry.get("is_p2p") else entry.get("collective_seq_id")
        newest[group] = {"name": entry.get("profiling_name", "?"), "seq": seq,
                         "waiting": not entry.get("retired", True), "p2p": bool(entry.get("is_p2p"))}
    return newest


def main_thread_stack(limit: int = 12) -> list[str]:
    """The main thread's Python stack, innermost last (what a stuck rank is doing)."""
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        text = f.read()
    blocks = text.split("\n\n")
    main = next((b for b in blocks if "(most recent call first)" in b and "phalanx-progress" not in b
                 and _is_main_block(b)), blocks[-1] if blocks else "")
    frames = [line.strip() for line in main.splitlines()[1:] if line.strip().startswith("File")]
    return list(reversed(frames[:limit]))


def _is_main_block(block: str) -> bool:
    ident = threading.main_thread().ident
    return ident is not None and f"0x{ident:016x}" in block


# --------------------------------------------------------------------------- parent side


class Watcher:
    """Reads every rank's progress from the store; names a hang once nothing moved for ``hang_timeout`` s."""

    def __init__(self, store: dist.Store, world_size: int, hang_timeout_s: float, label: Callable[[int], str],
                 expendable: Callable[[int], bool], lockstep: bool = True, interval_s: float = 1.0):
        self.store, self.world, self.timeout = store, world_size, hang_timeout_s
        self.label, self.expendable, self.lockstep, self.interval_s = label, expendable, lockstep, interval_s
        self.started = time.time()
        self.last_poll = 0.0
        self.states: dict[int, RankState] = {}

    def read(self) -> dict[int, RankState]:
        for rank in range(self.world):
            key = f"progress/{rank}"
            try:
                if self.store.check([key]):
                    self.states[rank] = RankState(**json.loads(self.store.get(key)))
            except Exception:  # the store is going away with the job
                continue
        return self.states

    def last_step(self, rank: int, since: Optional[float] = None, wait_s: float = 1.0) -> Optional[int]:
        """The step ``rank`` was in when last heard of (in a lockstep job: the furthest any rank reported).

        With ``since`` (a time, such as when ``rank`` was found dead): first wait, up to ``wait_s``, for a
        heartbeat of every other rank newer than that, so that the answer is where the job was then and
        not a beat older (ranks publish four times a second, and a fast job makes hundreds of steps in a
        beat: a stale answer named a step before the newest checkpoint).
        """
        deadline = time.time() + wait_s
        while since is not None and time.time() < deadline:
            states = self.read()
            others = [states.get(r) for r in range(self.world) if r != rank and not self.expendable(r)]
            if all(s is not None and s.beat >= since for s in others):  # (a fast job can die before any beat)
                break
            time.sleep(0.05)
        states = self.read()
        if self.lockstep and states:
            return max(state.step for state in states.values())
        return states[rank].step if rank in states else None

    def steps_made(self) -> bool:
        """Whether any rank has finished a step of this run (a rank is at step N + 1 while it makes step N + 1;
        a resumed run's ranks begin past 0, so a stop before its first step still reads as steps made)."""
        return any(state.step > 1 for state in self.read().values())

    def hung(self, now: Optional[float] = None) -> bool:
        """No rank the job needs has moved for the timeout. Start-up (spawning, importing, building the
        model, profiling, until every rank has begun its first step) is allowed at least :data:`STARTUP_S`: a
        rank says at once that its first step began, so one stopped a moment later is not taken for starting."""
        now = now or time.time()
        if self.timeout <= 0 or now - self.last_poll < self.interval_s:
            return False
        self.last_poll = now
        states = self.read()
        needed = [r for r in range(self.world) if not self.expendable(r)]
        if any(r not in states or states[r].step == 0 for r in needed):
            return now - self.started > max(self.timeout, STARTUP_S)
        return bool(needed) and now - max(states[r].moved for r in needed) > self.timeout

    def report(self, wait_s: float = 3.0) -> str:
        """Ask every rank for a dump, wait for the live ones, and say who is stuck where."""
        request = str(time.time())
        self.store.set("dump", request)
        deadline = time.time() + wait_s
        dumps: dict[int, dict] = {}
        while time.time() < deadline and len(dumps) < self.world:
            for rank in range(self.world):
                if rank not in dumps and self.store.check([f"dump/{rank}"]):
                    dumps[rank] = json.loads(self.store.get(f"dump/{rank}"))
            time.sleep(0.1)
        return describe_hang(self.read(), dumps, self.world, self.timeout, self.label, self.lockstep)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def exit_status(signame: str) -> int:
    """The shell's status for a job ended by this signal: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + int(getattr(signal, signame))


__all__ = ["Progress", "Watcher", "enable_flight_recorder", "exit_status", "has_raised", "is_gone",
           "launcher_view", "say_gone", "say_raised", "store_client"]
