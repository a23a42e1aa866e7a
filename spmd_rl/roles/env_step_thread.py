"""A vector env's step on a thread of its own, for env.pipeline_stages in one process (the colocated layout): the
main thread hands a stage's actions over and acts for another stage while this stage steps, then takes the step's
result. It overlaps only where the step waits without holding the GIL: envs that run in other processes (gymnasium's
AsyncVectorEnv, which the plan asks for), whose step mostly waits on their pipes.

The thread only calls `envs.step`: the rollout is recorded and every random number is drawn on the main thread, in
the order of one stage, so the thread changes the timing and nothing else. The main thread's wait for the result is
what the watchdog bounds (a stalled step is named by the env runner that waits for it), and an error the step
raises is raised again there, where the env runner names it as it names an error of a step on its own thread.
"""

from __future__ import annotations

import queue
import threading
import time


class EnvStepThread:
    def __init__(self, envs, name: str):
        self.envs = envs
        self._actions: queue.SimpleQueue = queue.SimpleQueue()  # an action batch to step with; None ends the thread
        self._results: queue.SimpleQueue = queue.SimpleQueue()  # (the step's result, its error, its seconds)
        self._in_flight = False
        # A daemon: a process that stops while a step is stuck in user code must not wait for it at exit.
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def start(self, action) -> None:
        """Step the envs with `action` (left alone by the caller until `wait` returns)."""
        self._in_flight = True
        self._actions.put(action)

    def wait(self) -> tuple[tuple, float]:
        """(the step's result, the seconds the step itself took); the step's error is raised here."""
        result, error, seconds = self._results.get()
        self._in_flight = False
        if error is not None:
            raise error
        return result, seconds

    def stop(self) -> None:
        """End the thread, after the step in flight (its result or error dropped: the run is ending)."""
        if self._in_flight:
            self._results.get()
            self._in_flight = False
        self._actions.put(None)
        self._thread.join()

    def _serve(self) -> None:
        while True:
            action = self._actions.get()
            if action is None:
                return
            clock = time.perf_counter()
            try:
                result = self.envs.step(action)
            except BaseException as exc:  # handed to the main thread, which names it (sys.exit in an env too)
                self._results.put((None, exc, time.perf_counter() - clock))
            else:
                self._results.put((result, None, time.perf_counter() - clock))
