"""The hang report: which rank is stuck and where, from what every rank published (pure logic).

Each rank publishes its progress (step, phase, when it last moved, its heartbeat: :class:`RankState`) and, when the
parent asks, a dump: its flight recorder's view of its collectives and its main thread's stack
(:class:`~phalanx.launcher.watch.Progress`). The stuck ranks are those outside any collective while others wait
in one; the report names them first, then who waits where.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional, Sequence


@dataclasses.dataclass
class RankState:
    step: int
    phase: str
    moved: float
    beat: float
    pid: int = 0


def _waiting_in(dump: Optional[dict]) -> Optional[tuple[str, Any]]:
    """(collective name, sequence number) this rank waits in, from its flight-recorder view."""
    if not dump:
        return None
    for view in dump.get("collectives", {}).values():
        if isinstance(view, dict) and view.get("waiting"):
            return view["name"], view["seq"]
    return None


def _join(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def describe_hang(states: dict[int, RankState], dumps: dict[int, dict], world: int, timeout_s: float,
                  label: Callable[[int], str], lockstep: bool = True, now: Optional[float] = None) -> str:
    """The hang report (pure: from what the ranks published). The first line names the stuck rank.

    The stuck ranks are those not waiting in a collective while others wait (or, if every rank
    waits, the one furthest behind). In a lockstep job the others wait in the stuck rank's current
    step, which says its step more exactly than its last heartbeat (up to a second old).
    """
    now = now or time.time()
    waiting = {r: _waiting_in(dumps.get(r)) for r in range(world)}
    in_collective = [r for r in range(world) if waiting[r] is not None]
    stuck = [r for r in range(world) if waiting[r] is None] or \
        sorted(in_collective, key=lambda r: (states[r].step if r in states else -1))[:1]

    def alive(r: int) -> bool:
        return r in dumps and r in states and now - states[r].beat < 3 * timeout_s

    # Alive ranks outside any recorded collective beside stopped or frozen ones wait for those: in a wait no
    # flight recorder shows (gloo records no point-to-point op: a pipeline's stages).
    held = [r for r in stuck if alive(r)] if any(not alive(r) for r in stuck) else []
    stuck = [r for r in stuck if r not in held]
    waiting_steps = [states[r].step for r in in_collective + held if r in states and r not in stuck]
    parts = []
    for r in stuck:
        state = states.get(r)
        if state is None:
            parts.append(f"{label(r)} never reported (it did not start)")
            continue
        step = max([state.step] + ([min(waiting_steps)] if lockstep and waiting_steps else []))
        how = "alive and busy" if alive(r) else \
            f"process stopped or frozen: no heartbeat for {now - state.beat:.0f} s"
        collective = waiting[r]
        where = "not in a collective" if collective is None else f"in {collective[0]} (collective {collective[1]})"
        parts.append(f"{label(r)} is stuck in step {step}, in {state.phase}, {where} (no progress for "
                     f"{now - state.moved:.0f} s; {how})")
    groups: dict[tuple, list[int]] = {}
    for r in in_collective:
        collective = waiting[r]
        if r not in stuck and collective is not None:
            at = states[r].step if r in states else "?"
            groups.setdefault((collective[0], collective[1], at), []).append(r)
    for (name, seq, at), ranks in sorted(groups.items(), key=lambda kv: kv[1]):
        verb = "waits" if len(ranks) == 1 else "wait"
        parts.append(f"{_join([label(r) for r in ranks])} {verb} in {name} (collective {seq}) of step {at}")
    for r in held:
        parts.append(f"{label(r)} waits in step {states[r].step}, in {states[r].phase}, alive, outside any "
                     "collective torch records (such as a point-to-point receive or send)")
    lines = ["; ".join(parts)]
    for r in stuck:
        stack = (dumps.get(r) or {}).get("stack") or []
        if stack:
            lines.append(f"{label(r)}'s stack, innermost last:")
            lines += [f"  {frame}" for frame in stack[-6:]]
    return "\n".join(lines)
