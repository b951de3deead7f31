"""``StepExecutor``: runs a runner's steps in launch order and lets host work overlap them
(zero-overhead scheduling). It knows runners only through ``runner.StepRunner``."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

import torch

from pdinfer.worker.step_input import StepInput, StepResult

if TYPE_CHECKING:
    from pdinfer.worker.runner import PendingResult, StepRunner


class StepFuture(Protocol):
    """A launched step: a ``Future``, or with asynchronous results a ``DeviceStepFuture`` around one."""

    def result(self, timeout: float | None = None) -> StepResult: ...

    def done(self) -> bool: ...


class DeviceStepFuture:
    """A step future whose ``result()`` also waits for the device (the sampling sync)."""

    def __init__(self, inner: Future):
        self._inner = inner

    def result(self, timeout: float | None = None) -> StepResult:
        value = self._inner.result(timeout)
        return value if isinstance(value, StepResult) else value.wait()

    def done(self) -> bool:
        return self._inner.done()

    def exception(self, timeout: float | None = None):
        return self._inner.exception(timeout)


def _bind_device(device: torch.device) -> None:
    """The step thread works on the engine's GPU ("cuda:N"; the current device is per thread)."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


class _CallerStep(Future):
    """A launched CPU step that the calling thread runs: in ``StepExecutor.overlap_with`` while
    the helper thread does host work, or when first waited for, whichever comes first."""

    def __init__(self, executor: StepExecutor, inp: StepInput):
        super().__init__()
        self._executor = executor
        self._inp: StepInput | None = inp  # None once run
        self.overlapped = False  # run by ``overlap_with``, whose helper settles deferred masks

    def run(self) -> None:
        if self.done():  # without the lock: the helper must not wait for the step running now
            return
        deferred = self._inp.masks_later if self._inp is not None else None
        if deferred is not None and not self.overlapped:
            deferred.settle()  # run before its host work (a step-ordered call): settle it here
        with self._executor._lock:  # steps and step-ordered calls never interleave
            if self.done() or self._inp is None:
                return
            try:
                self.set_result(self._executor.runner.execute(self._inp))
            except BaseException as exc:  # noqa: BLE001 - delivered to whoever waits on it
                self.set_exception(exc)
            finally:
                self._inp = None

    def result(self, timeout=None):
        self.run()
        return super().result(timeout)


class StepExecutor:
    """Runs steps in order, and lets host work overlap them (zero-overhead scheduling).

    Without overlap every step runs inline in ``launch``. With overlap on a GPU, steps run on one
    worker thread: the host schedules and processes outputs of step N while the device computes
    step N+1. On the CPU the overlap goes the other way round: the forward runs on the calling
    thread (``overlap_with``) while the helper thread processes the previous step's outputs. A CPU
    forward already uses every core through OpenMP, and starting its parallel regions from a
    second thread gives the process a second OpenMP pool, more threads than cores, and libgomp's
    throttled spinning, which makes batch-1 decode markedly slower. Steps still execute
    strictly in launch order.
    """

    def __init__(self, runner: StepRunner, overlap: bool):
        self.runner = runner
        self.overlap = overlap
        self.forward_on_caller = overlap and not runner.async_results
        self._pool = (
            ThreadPoolExecutor(
                1, thread_name_prefix="pdinfer-step", initializer=_bind_device, initargs=(runner.device,)
            )
            if overlap
            else None
        )
        self._lock = threading.Lock()
        self._last: _CallerStep | None = None

    def launch(self, inp: StepInput) -> StepFuture:
        if self.forward_on_caller:
            if self._last is not None:
                self._last.run()  # launch order is execution order
            self._last = _CallerStep(self, inp)
            return self._last
        future: Future  # of a StepResult, or of a PendingResult (asynchronous results)
        if self._pool is not None:
            future = self._pool.submit(self._run, inp)
        else:
            future = Future()
            try:
                future.set_result(self._run(inp))
            except BaseException as exc:  # noqa: BLE001 - delivered to whoever waits on it
                future.set_exception(exc)
        if self.runner.async_results:
            return DeviceStepFuture(future)  # result() also waits for the device
        return future

    def overlap_with(self, step: StepFuture | None, host_work):
        """``host_work()``'s result, computed while ``step`` (just launched) runs."""
        if isinstance(step, _CallerStep) and not step.done() and self._pool is not None:
            helper = self._pool.submit(host_work)
            step.overlapped = True
            step.run()
            return helper.result()
        return host_work()

    def _run(self, inp: StepInput) -> StepResult | PendingResult:
        with self._lock:
            return self.runner.execute(inp)

    def submit_call(self, fn, *args) -> Future:
        """Run ``fn`` in step order (after every launched step), e.g. a KV copy."""
        if self._pool is not None and not self.forward_on_caller:
            return self._pool.submit(self._locked, fn, *args)
        if self._last is not None:
            self._last.run()  # a launched step not yet run goes first
        future: Future = Future()
        future.set_result(self._locked(fn, *args))
        return future

    def _locked(self, fn, *args):
        with self._lock:
            return fn(*args)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
