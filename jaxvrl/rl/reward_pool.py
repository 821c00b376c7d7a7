"""Reward calls off the main thread, each bounded by a timeout: `RewardPool` runs them in
`num_workers` worker processes (fresh interpreters; each loads the functions by their `module:function` /
`path.py:function` specs), or with 0 on one daemon thread of this process. A call past
`timeout_s`, or one whose worker dies, is a timeout: its rows score 0 and its worker is
killed and replaced (a thread cannot be killed: it is abandoned, and leaks until its call
returns). Pure Python (no jax)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import multiprocessing
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing import connection

from jaxvrl.rl.reward_forms import Form, RewardFormError, all_finite, call
from jaxvrl.rl.rewards import load_reward_fn

POLL_S = 0.05  # how often a wait looks at the stop flag
_BOOT = "import sys; from jaxvrl.reward_worker import main; main(int(sys.argv[1]))"


class RewardsInterrupted(Exception):
    """The stop flag was raised (SIGTERM) while reward calls were running; they were
    abandoned."""


@dataclasses.dataclass
class Outcome:
    """One call's result: scores [(reward, {sub-score: value})] per row, or None when it
    failed: `error` one line ("RuntimeError: ..."), `trace` the traceback, `timed_out` for a
    call past the timeout or whose worker died."""

    scores: list | None = None
    error: str | None = None
    trace: str = ""
    timed_out: bool = False


def run_call(fn, form: Form, kwargs: dict, rows: list, constants: dict) -> Outcome:
    """One call of `fn` in its form; never raises."""
    try:
        scores = call(fn, form, rows, kwargs, constants)
        if not all_finite(scores):
            bad = [v for v, _ in scores if not math.isfinite(v)][:3]
            raise RewardFormError(f"returned non-finite values {bad}")
        return Outcome(scores)
    except (Exception, SystemExit) as e:  # noqa: BLE001 -- a user reward must not stop the run
        return Outcome(error=f"{type(e).__name__}: {e}", trace=traceback.format_exc())


def serve(conn, specs: list[str], forms: list[Form], kwargs: list[dict]) -> None:
    """A worker's loop: load the functions, say ready, then answer (task id, fn index, rows,
    constants) with (task id, Outcome) until None or the pipe closes."""
    try:
        fns = [load_reward_fn(s) for s in specs]
    except Exception as e:  # noqa: BLE001 -- told to the trainer, which stops using workers
        conn.send(("broken", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        tid, i, rows, constants = task
        conn.send((tid, run_call(fns[i], forms[i], kwargs[i], rows, constants)))


class _ThreadSlot:
    """A daemon thread that runs calls one at a time in this process."""

    def __init__(self, fns, forms, kwargs):
        self.conn, writer = multiprocessing.Pipe(duplex=False)
        self.inbox = queue.SimpleQueue()
        self.ready, self.task, self.deadline = True, None, math.inf

        def loop(inbox=self.inbox):
            while (task := inbox.get()) is not None:
                tid, i, rows, constants = task
                out = run_call(fns[i], forms[i], kwargs[i], rows, constants)
                try:
                    writer.send((tid, out))
                except OSError:  # abandoned after its timeout: nobody reads any more
                    return

        threading.Thread(target=loop, daemon=True, name="jaxvrl-reward").start()

    def waitables(self):
        return [self.conn]

    def send(self, task):
        self.inbox.put(task)

    def dead(self) -> bool:
        return False

    def kill(self):
        self.inbox.put(None)  # the abandoned thread ends when (if) its call returns
        self.conn.close()


class _ProcessSlot:
    """A worker process: a fresh interpreter running jaxvrl/reward_worker.py, joined by a
    socket pair. Not multiprocessing's spawn: that imports the trainer's main module (and with
    it jax) in every worker."""

    def __init__(self, specs, forms, kwargs):
        ours, theirs = socket.socketpair()
        fd = theirs.fileno()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, str(fd)],
            pass_fds=(fd,),
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        )
        theirs.close()
        self.conn = connection.Connection(ours.detach())
        self.conn.send((specs, forms, kwargs))
        self.ready, self.task, self.deadline = False, None, math.inf

    def waitables(self):
        return [self.conn]

    def send(self, task):
        self.conn.send(task)

    def dead(self) -> bool:
        return self.proc.poll() is not None

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5)
        self.conn.close()


class RewardPool:
    """Runs calls of the reward functions `specs` (loaded here as `fns`, of forms `forms`,
    with keyword arguments `kwargs`, one per function) on `num_workers` processes (0: one
    thread of this process), each call bounded by `timeout_s` (math.inf: unbounded).
    `submit` queues a call and returns its id; `collect` waits for calls, polling `stop`.
    Workers start at the first `collect` and stay until `close`."""

    def __init__(self, specs, fns, forms, kwargs, num_workers: int = 0, timeout_s=math.inf):
        self.specs, self.fns, self.forms, self.kwargs = list(specs), fns, forms, kwargs
        self.num_workers, self.timeout_s = num_workers, timeout_s
        self.slots: list = []
        self.pending: list = []  # queued tasks, in order
        self.done: dict[int, Outcome] = {}
        self.replaced = 0  # workers killed and replaced (timeouts, deaths)
        self.broken: str | None = None  # why workers could not load the functions
        self._ids = itertools.count()

    def _new_slot(self):
        if self.num_workers == 0:
            return _ThreadSlot(self.fns, self.forms, self.kwargs)
        return _ProcessSlot(self.specs, self.forms, self.kwargs)

    def start(self) -> None:
        """Start the workers (else the first `collect` does)."""
        while self.broken is None and len(self.slots) < max(self.num_workers, 1):
            self.slots.append(self._new_slot())

    def submit(self, fn_index: int, rows: list, constants: dict | None = None) -> int:
        tid = next(self._ids)
        self.pending.append((tid, fn_index, rows, constants or {}))
        return tid

    def collect(self, ids: list[int], stop: Callable[[], bool] | None = None) -> list[Outcome]:
        """The outcomes of calls `ids`, once all are done. Raises RewardsInterrupted when
        `stop()` turns true first (the running calls are killed or abandoned)."""
        self.start()
        while any(i not in self.done for i in ids):
            if self.broken is not None:
                self._fail_pending()
            self._dispatch()
            if stop is not None and stop():
                self._abandon_running()
                raise RewardsInterrupted("stop requested while the rewards ran")
            busy = [s for s in self.slots if s.task is not None]
            now = time.monotonic()
            wait_s = min([POLL_S if stop else 1.0] + [s.deadline - now for s in busy])
            objs = [o for s in self.slots for o in s.waitables()]
            connection.wait(objs, timeout=max(wait_s, 0.0))
            for k, slot in enumerate(self.slots):
                self._read(k, slot)
            self.slots = [s for s in self.slots if s is not None]
        return [self.done.pop(i) for i in ids]

    def _dispatch(self) -> None:
        for slot in self.slots:
            if not self.pending:
                return
            if slot.ready and slot.task is None:
                task = self.pending.pop(0)
                try:
                    slot.send(task)
                except Exception as e:  # noqa: BLE001 -- e.g. a row that cannot be pickled
                    self.done[task[0]] = Outcome(error=f"{type(e).__name__}: {e} (sending rows)")
                    continue
                slot.task, slot.deadline = task[0], time.monotonic() + self.timeout_s

    def _read(self, k: int, slot) -> None:
        """Take what slot `k` sent; replace it when it is dead or past its deadline."""
        try:
            while slot.conn.poll():
                tag, value = slot.conn.recv()
                if tag == "ready":
                    slot.ready = True
                elif tag == "broken":
                    self.broken = value
                elif tag == slot.task:
                    self.done[tag] = value
                    slot.task, slot.deadline = None, math.inf
        except (EOFError, OSError):
            pass
        dead, late = slot.dead(), time.monotonic() > slot.deadline
        if not (dead or late):
            return
        if slot.task is not None:
            what = f"timed out after {self.timeout_s:g} s" if late else "its worker died"
            if dead and not late:
                what += f" (exit code {slot.proc.returncode})"
            self.done[slot.task] = Outcome(error=f"the call {what}", timed_out=True)
        slot.kill()
        self.slots[k] = None if self.broken else self._new_slot()
        self.replaced += 1

    def _fail_pending(self) -> None:
        """Workers that cannot load the functions: every queued call fails with the reason."""
        for task in self.pending:
            why = f"RuntimeError: the reward workers cannot load the functions: {self.broken}"
            self.done[task[0]] = Outcome(error=why)
        self.pending.clear()

    def _abandon_running(self) -> None:
        for slot in self.slots:
            if slot.task is not None:
                slot.kill()
        self.slots = [s for s in self.slots if s.task is None]
        self.pending.clear()

    def close(self) -> None:
        """Ask the workers to exit, then kill those still running after a second."""
        for slot in self.slots:
            try:
                slot.send(None)
            except Exception:  # noqa: BLE001 -- a dead worker's pipe
                pass
        end = time.monotonic() + 1.0
        for slot in self.slots:
            if isinstance(slot, _ProcessSlot):
                try:
                    slot.proc.wait(max(end - time.monotonic(), 0.0))
                except subprocess.TimeoutExpired:
                    pass
            slot.kill()
        self.slots = []
