"""The stop recipe in one line: ``sdc.exit_on_sdc(monitor)`` around any training loop, function or not.

    monitor = sdc.SDCMonitor(model, optimizer, loss_fn=compute_loss, config=sdc.SDCConfig(on_suspect="raise"))
    with sdc.exit_on_sdc(monitor):
        for batch in loader:
            with monitor.step(batch) as step:
                step.backward(compute_loss(model, batch))
            optimizer.step()
            optimizer.zero_grad()
            if step_index % 1000 == 0:
                save(monitor.certificate())      # certificate() may raise SDCDetected too: covered
    # reached only after a normal end; the monitor is closed

``SDCDetected`` anywhere in the block (a step, ``certificate()``, ``verify_weights()``, the final ``close()``, or an
exception raised while one unwound): the monitor is closed without collectives (milliseconds: the incident and the
page were flushed before the monitor raised), one line says why this rank stops, stdout, stderr and the logging
handlers are flushed, and the process exits with ``sdc.EXIT_SDC`` (75) through ``os._exit`` (with gloo a process can
abort in interpreter teardown after a peer left, which would lose the exit code; code after the block, ``finally``
clauses outside it and ``atexit`` handlers do not run). A normal end closes the monitor (a verdict still in flight on
CUDA is decided there, and can stop the rank the same way). Any other exception closes the monitor on its exception
path (no collective, nothing raised over it) and propagates.

Launchers race the stop: once the first rank exits, ``torchrun`` sends SIGTERM to the ranks still running (within
its 0.1 s monitor interval), and so do Slurm and Kubernetes to a job step or pod. While the block runs, a SIGTERM
that finds this rank already stopping on an SDC incident (the monitor decided to raise: its incident is open, the
page may still be in flight) is held back: the rank finishes its stop and exits 75, at the latest ``STOP_GRACE_S``
seconds later. Any other SIGTERM goes to the handler that was installed before (by default: the process ends as it
would have). So every rank exits 75 whichever rank is first.

``monitor`` is the ``SDCMonitor``, or the object that builds one and holds it in ``.sdc_monitor`` or ``.monitor``
(``sdc_telemetry.transformers.SDCTrainer``, ``sdc_telemetry.lightning.SDCCallback``), read when needed::

    with sdc.exit_on_sdc(trainer):               # Hugging Face
        trainer.train()
    with sdc.exit_on_sdc(callback):              # Lightning
        pl_trainer.fit(model, loader)

It is also a decorator (``@sdc.exit_on_sdc(monitor)``), and ``sdc.exit_on_sdc()`` without a monitor still exits 75
on ``SDCDetected`` (nothing to close; a SIGTERM is held back only once ``SDCDetected`` is on its way).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any, NoReturn

from sdc_telemetry.core.incident import EXIT_SDC, SDCDetected
from sdc_telemetry.monitor import SDCMonitor

__all__ = ["exit_on_sdc", "guard_sigterm", "stopping", "STOP_GRACE_S"]

log = logging.getLogger("sdc_telemetry")

# A SIGTERM held back on the stop path: the rank exits 75 at most this long after it, whatever its stop is doing
# (launchers send SIGKILL 30 s after SIGTERM by default: torchrun, Slurm's KillWait, Kubernetes' grace period).
STOP_GRACE_S = 15.0

_HOLDERS = ("sdc_monitor", "monitor")  # where SDCTrainer and SDCCallback keep the monitor they build

Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class exit_on_sdc(contextlib.ContextDecorator):
    """Context manager (and decorator) that turns ``SDCDetected`` into exit code 75 on every rank, also when the
    launcher sends SIGTERM to ranks still stopping. See the module docstring.

    >>> with sdc.exit_on_sdc(monitor):                                        # doctest: +SKIP
    ...     for batch in loader:
    ...         with monitor.step(batch) as step:
    ...             step.backward(compute_loss(model, batch))
    ...         optimizer.step()
    ...         optimizer.zero_grad()
    """

    def __init__(self, monitor: Any = None) -> None:
        _check_source(monitor)
        self._source = monitor
        self._installed: list[_SigtermHandler | None] = []  # one per open block (a decorated function may recurse)

    def __enter__(self) -> exit_on_sdc:
        self._installed.append(_install(self._source))
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        handler = self._installed.pop() if self._installed else None
        try:
            monitor = _resolve(self._source)
            detected = _sdc_in(exc)
            if exc is None:
                if monitor is not None and not monitor.closed:
                    try:
                        monitor.close()  # a normal end (on CUDA the last verdict is decided here)
                    except SDCDetected as e:
                        _stop(e, monitor)
            elif detected is not None:
                _stop(detected, monitor)
            elif monitor is not None and not monitor.closed:
                monitor.__exit__(exc_type, exc, tb)  # an exception path: no collective, nothing raised over it
        finally:
            if handler is not None:
                handler.uninstall()


class guard_sigterm:
    """Puts a SIGTERM handler in front of the one installed now (a framework's, such as Lightning's, which runs a
    collective), so that a SIGTERM on the SDC stop path of ``source``'s monitor is held back (exit 75 when the stop
    is done); any other SIGTERM goes to that handler. ``release()`` puts it back if nothing replaced the guard since.
    Does nothing outside the main thread (Python runs signal handlers there only)."""

    def __init__(self, source: Any) -> None:
        _check_source(source)
        self._handler = _install(source)

    def release(self) -> None:
        if self._handler is not None:
            self._handler.uninstall()
            self._handler = None


def stopping(monitor: SDCMonitor | None) -> bool:
    """This process is on its SDC stop path: a stop began here, ``SDCDetected`` is being handled, or ``monitor``
    has decided to raise (``on_suspect="raise"`` and an incident with suspects is open: from the moment the
    episode opens, before the incident is logged and paged, until the process exits)."""
    if _STATE.stopping or isinstance(sys.exc_info()[1], SDCDetected):
        return True
    if monitor is None:
        return False
    try:
        return bool(monitor.config.on_suspect == "raise" and any(i.suspect_ranks for i in monitor.incidents))
    except Exception:  # noqa: BLE001 - a signal handler must not fail on a half-built monitor
        return False


# -- the process's stop state --------------------------------------------------------------------------------------

class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stopping = False
        self.deadline: threading.Timer | None = None


_STATE = _State()


def _stop(e: SDCDetected, monitor: SDCMonitor | None) -> NoReturn:
    """Close the monitor (no collective), say why, flush, exit with ``e.exit_code`` (75)."""
    _STATE.stopping = True
    code = int(getattr(e, "exit_code", EXIT_SDC))
    start = time.perf_counter()
    if monitor is not None and not monitor.closed:
        try:
            monitor.close()  # on the stop path: no collective, never raises
        except BaseException:
            log.exception("sdc_telemetry: closing the monitor on the SDC stop failed")
    closed_ms = (time.perf_counter() - start) * 1000
    rank = monitor.rank if monitor is not None else os.environ.get("RANK", "?")
    log.error("sdc_telemetry: rank %s stops with exit code %d (monitor closed in %.1f ms): %s", rank, code,
              closed_ms, e)
    _exit(code)


def _exit(code: int) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001,S110 - a closed stream must not cost the exit code
            pass
    try:
        logging.shutdown()  # what atexit would do: flush and close the logging handlers
    except Exception:  # noqa: BLE001,S110
        pass
    os._exit(code)


def _hold_back(signum: int) -> None:
    """A SIGTERM on the stop path: let the stop finish, and exit 75 within ``STOP_GRACE_S`` whatever it does."""
    with _STATE.lock:
        if _STATE.deadline is not None:
            return
        _STATE.deadline = threading.Timer(STOP_GRACE_S, _deadline_exit)
        _STATE.deadline.daemon = True
        _STATE.deadline.start()
    _write_stderr(f"sdc_telemetry: signal {signum} while stopping on an SDC incident: this rank exits with "
                  f"{EXIT_SDC} when its stop is done (within {STOP_GRACE_S:g}s)\n")


def _deadline_exit() -> None:
    _write_stderr(f"sdc_telemetry: the SDC stop did not finish within {STOP_GRACE_S:g}s of SIGTERM; exiting with "
                  f"{EXIT_SDC}\n")
    _exit(EXIT_SDC)


def _write_stderr(text: str) -> None:
    try:
        os.write(2, text.encode())  # from a signal handler: no lock that an interrupted logging call may hold
    except OSError:
        pass


# -- the SIGTERM handler -------------------------------------------------------------------------------------------

class _SigtermHandler:
    """SIGTERM on the stop path of the source's monitor: held back. Otherwise: the previous handler."""

    def __init__(self, source: Any, previous: Handler) -> None:
        self.source = source
        self.previous = previous

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if stopping(_resolve(self.source)):
            _hold_back(signum)
            return
        previous = self.previous
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:  # the default action (or none from Python): end the process as it would
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def uninstall(self) -> None:
        """Put the previous handler back, unless something replaced this one since."""
        previous = self.previous if self.previous is not None else signal.SIG_DFL
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is self:
            signal.signal(signal.SIGTERM, previous)


def _install(source: Any) -> _SigtermHandler | None:
    if threading.current_thread() is not threading.main_thread():
        return None  # signal handlers can only be set, and only run, in the main thread
    handler = _SigtermHandler(source, signal.getsignal(signal.SIGTERM))
    signal.signal(signal.SIGTERM, handler)
    return handler


# -- plumbing ------------------------------------------------------------------------------------------------------

def _check_source(source: Any) -> None:
    if source is None or isinstance(source, SDCMonitor) or any(hasattr(source, a) for a in _HOLDERS):
        return
    raise TypeError(f"exit_on_sdc(monitor): expected an SDCMonitor, or an object that holds one in .sdc_monitor or "
                    f".monitor (SDCTrainer, SDCCallback), or None; got {type(source).__name__}")


def _resolve(source: Any) -> SDCMonitor | None:
    """The monitor ``source`` is, or holds now (an integration builds its monitor when training starts)."""
    if source is None or isinstance(source, SDCMonitor):
        return source
    for attr in _HOLDERS:
        held = getattr(source, attr, None)
        if isinstance(held, SDCMonitor):
            return held
    return None


def _sdc_in(exc: BaseException | None) -> SDCDetected | None:
    """``exc`` if it is ``SDCDetected``, else the ``SDCDetected`` it was raised from or while handling."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, SDCDetected):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
