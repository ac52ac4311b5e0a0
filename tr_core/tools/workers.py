"""Who decodes a benchmark's questions: one worker in this process (``LocalPool``), or Ray actors on this machine's
cores or on a cluster's (``RayPool``); and the loop that hands them the run's units, question by question, and writes
each finished question to the run's folder as it comes (``drive``).

A unit is one shard of questions at one temperature; it stays on one worker from question to question (the worker
holds its matrices), and goes to another worker, with the state its last finished question left, when its worker
dies. Ray restarts a dead actor and retries its call once (``max_restarts``, ``max_task_retries``) before this loop
sees the loss; a worker lost for good is replaced by a new one.

Ray is imported only by ``RayPool``: a run without ``--ray`` needs no Ray.
"""

from __future__ import annotations

import os
import re
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .run_folder import RunFolder

ROOT = Path(__file__).resolve().parents[2]
# A local Ray (no address) binds its processes to 127.0.0.1 (Ray's own switch for laptops) and sends no usage
# statistics; a cluster's address is the user's own network.
LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0"}


@dataclass
class Unit:
    temperature: int
    shard: int
    ids: list[int]  # the shard's questions, in the order decoded
    position: int = 0  # the place of the next question
    state: bytes | None = None  # what the finished questions left, for the next

    @property
    def left(self) -> int:
        return len(self.ids) - self.position


class WorkerLost(Exception):
    """A worker died (its process ended, its machine left the cluster) after Ray's own retries."""


class LocalPool:
    """One worker, in this process: a run without ``--ray``. The worker may set torch's thread count (``--threads``);
    ``close`` sets the process's back, so a benchmark called from other code (a test) leaves it as it found it."""

    def __init__(self, make_worker: Callable[[str], object]):
        self._threads = torch.get_num_threads()
        try:
            self.worker = make_worker("w0")
        except BaseException:
            self.close()
            raise
        self.workers = ["w0"]
        self._done: dict[int, object] = {}

    def submit(self, name: str, unit: Unit) -> int:
        handle = len(self._done)
        self._done[handle] = self.worker.run_question((unit.temperature, unit.shard), unit.position,
                                                      unit.ids[unit.position], unit.state)
        return handle

    def wait(self, handles: list[int]) -> tuple[int, object]:
        return handles[0], self._done.pop(handles[0])

    def replace(self, name: str) -> str | None:
        return None

    def finish(self) -> list[dict]:
        return [self.worker.finish()]

    def close(self) -> None:
        torch.set_num_threads(self._threads)


class RayPool:
    """``count`` Ray actors of ``worker_class``, each reserving ``cpus`` cores (and ``gpus`` GPUs; None: one where the
    cluster has any), on a local Ray (``address`` None) or the cluster at ``address``; ``count`` None: as many as the
    cluster holds."""

    def __init__(self, worker_class: type, args: tuple, address: str | None, count: int | None, cpus: int,
                 gpus: float | None = 0):
        for key, value in (RAY_ENV if address else LOCAL_RAY_ENV).items():
            os.environ.setdefault(key, value)
        try:
            import ray
        except ImportError:
            raise ValueError("--ray needs Ray: pip install -r requirements-dev.txt (it pins ray)") from None
        self.ray = ray
        runtime_env = None
        if address:  # a cluster's machines get this checkout (without its virtual environment and run folders)
            runtime_env = {"working_dir": str(ROOT), "excludes": [".venv/", ".git/", "bench_out*/", "__pycache__/"]}
        ray.init(address=address, include_dashboard=False, configure_logging=False, log_to_driver=False,
                 runtime_env=runtime_env, **({} if address else {"num_cpus": os.cpu_count()}))
        total = ray.cluster_resources()
        if gpus is None:  # --device auto: a GPU a worker where the cluster has them
            gpus = 1 if total.get("GPU", 0) >= 1 else 0
        if count is None:
            count = int(total.get("GPU", 0) // gpus) if gpus else int(total.get("CPU", 1) // cpus)
        if count < 1:
            ray.shutdown()
            raise ValueError(f"the Ray cluster has {total.get('CPU', 0):g} CPU(s) and {total.get('GPU', 0):g} "
                             f"GPU(s): not enough for one worker of {cpus} CPU(s) and {gpus:g} GPU(s)")
        self.remote = ray.remote(num_cpus=cpus, num_gpus=gpus, max_restarts=1, max_task_retries=1)(worker_class)
        # the workers' arguments (the options, every question) put in Ray's store once and held here, so that a
        # restarted worker still finds them
        self.args, self.cpus, self.actors, self.next = tuple(ray.put(a) for a in args), cpus, {}, 0
        self.workers = [self._start() for _ in range(count)]
        self.address = address or "local"
        for name in self.workers:  # each loads the model and fits its trees now; one that cannot stops the run
            try:
                ray.get(self.actors[name].ready.remote())
            except ray.exceptions.RayActorError as e:
                ray.shutdown()
                raise ValueError(f"worker {name} could not start: {cause_of(e)}") from None

    def _start(self) -> str:
        name = f"w{self.next}"
        self.next += 1
        self.actors[name] = self.remote.remote(*self.args, name=name, threads=self.cpus)
        return name

    def submit(self, name: str, unit: Unit):
        return self.actors[name].run_question.remote((unit.temperature, unit.shard), unit.position,
                                                      unit.ids[unit.position], unit.state)

    def wait(self, handles: list) -> tuple[object, object]:
        ready, _ = self.ray.wait(handles, num_returns=1)
        try:
            return ready[0], self.ray.get(ready[0])
        except self.ray.exceptions.RayActorError as e:
            if getattr(e, "actor_init_failed", False):  # restarted, it could not set up again: no use retrying
                raise ValueError(f"a restarted worker could not start: {cause_of(e)}") from None
            return ready[0], WorkerLost(cause_of(e))
        except self.ray.exceptions.RayTaskError as e:  # the worker's own error (a model that does not load, a bug)
            raise e.as_instanceof_cause() from None

    def replace(self, name: str) -> str | None:
        """A new actor in place of a lost one (None when the cluster has no room left for one)."""
        self.actors.pop(name, None)
        return self._start()

    def finish(self) -> list[dict]:
        out = []
        for ref in [actor.finish.remote() for actor in self.actors.values()]:  # the workers' last t(N) at once
            try:
                out.append(self.ray.get(ref))
            except self.ray.exceptions.RayError:
                continue
        return out

    def close(self) -> None:
        self.ray.shutdown()


def cause_of(error: Exception) -> str:
    """The line of a Ray error that says what happened: the worker's own exception where it raised one (``ValueError:
    ...``), else the error's first line.

    >>> cause_of(RuntimeError("The actor died because of an error raised in its creation task\\n  File x\\n"
    ...                       "ValueError: no such model"))
    'ValueError: no such model'
    """
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    raised = [line for line in lines if re.match(r"^[A-Za-z_.]*(Error|Exception): ", line)]
    return raised[-1] if raised else (lines[0] if lines else type(error).__name__)


def drive(pool, folder: RunFolder, units: list[Unit], on_line: Callable[[dict, str], None],
          on_change: Callable[[dict], None] = lambda status: None, max_losses: int = 8) -> dict:
    """Run every question left in ``units`` on ``pool``'s workers: each worker takes a unit and runs its questions
    in order, one call at a time; every finished question is appended to ``folder`` (then its unit's state saved)
    and passed to ``on_line``. A lost worker's unit goes back to the queue, from its last finished question, and a
    new worker takes the lost one's place (``max_losses`` losses in all, then the run stops: something kills every
    worker). ``on_change`` gets the counts after each event; the last counts are returned."""
    queue = deque(u for u in units if u.left > 0)
    idle = list(pool.workers)
    running: dict = {}
    done, lost = Counter(), 0

    def status() -> dict:
        return {"running": len(running), "failed": lost, "done": dict(done), "left": sum(u.left for u in queue)}

    while queue or running:
        while idle and queue:
            name, unit = idle.pop(0), queue.popleft()
            running[pool.submit(name, unit)] = (name, unit)
        on_change(status())
        handle, outcome = pool.wait(list(running))
        name, unit = running.pop(handle)
        if isinstance(outcome, WorkerLost):
            lost += 1
            if lost > max_losses:
                raise RuntimeError(f"{lost} workers were lost (the last: {outcome}); the questions finished so far "
                                   f"are in {folder.path}: go on with --resume {folder.path}")
            queue.appendleft(unit)
            fresh = pool.replace(name)
            if fresh is not None:
                idle.append(fresh)
            if not idle and not running:
                raise RuntimeError(f"no worker left to run the {sum(u.left for u in queue)} question(s) left")
            continue
        line, state = outcome
        folder.append(line)
        folder.save_state(unit.temperature, unit.shard, unit.position + 1, state)
        unit.position, unit.state = unit.position + 1, state
        done[name] += 1
        on_line(line, name)
        if unit.left > 0:
            running[pool.submit(name, unit)] = (name, unit)
        else:
            idle.append(name)
    on_change(status())
    return status()
