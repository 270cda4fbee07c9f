"""Heartbeats: where this rank's training thread is, sent every few seconds whatever it does.

    liveness = Liveness(first_step=0)
    phases = PhaseHooks(model, liveness)          # forward, backward, optimizer
    sender = HeartbeatSender(url, run_id, rank, liveness, interval_s=2.0)
    ... monitor.step() calls liveness.finished(step) ...
    sender.close()                                # a last heartbeat with phase "ended"
    phases.close()

The training thread only assigns plain Python attributes (`Liveness`): no device read, no
lock, no I/O. A daemon thread reads them every `interval_s` and POSTs one small JSON batch
to the collector's /api/v1/heartbeats (collector/heartbeat.py), where the watchdog judges
liveness on the clock (analyzer/liveness.py). Independent of steps and of log_every, so a
hung or crashed rank is seen by what it stops sending.

A dead collector costs the training thread nothing: the sender waits at most `timeout_s`
per attempt on its own thread, keeps no backlog (a late heartbeat is worthless) and counts
what it could not deliver (`failed`). A process that ends without close() (an exception,
or the SIGTERM with which torchrun tears down the other ranks after one failed) says so with
a last heartbeat of phase "exited", so that the watchdog tells the rank that crashed
silently from the ranks that ended after it; `os._exit` and SIGKILL send nothing, as a
crash or a lost node would not. Before that heartbeat, `last_words` (the monitor's export
flush, bounded) sends the telemetry still queued: the steps a rank trained before a peer
crashed reach the store. The SIGTERM handler is installed only where the program left
SIGTERM at its default, and ends the process as the default would.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson
import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from trainvitals.schema import PAUSES, SCHEMA_VERSION

from .layers import OptimizerParams, first_float_tensor

log = logging.getLogger(__name__)

LAST_WORDS_MAX_S = 10.0  # the most an ending process waits for `last_words`


class Liveness:
    """What the heartbeat reports, set by the training thread (plain attributes: a reader on
    another thread sees each assignment whole, under the GIL)."""

    def __init__(self, first_step: int = 0) -> None:
        self.current_step = first_step  # the step the training thread is on or about to begin
        self.step_started = first_step - 1
        self.step_finished = first_step - 1
        self.phase = "idle"

    def finished(self, step: int) -> None:
        """monitor.step(): `step` is done; the time until the next forward is data wait."""
        self.step_finished = step
        self.current_step = step + 1
        self.phase = "data_wait"


class PhaseHooks:
    """Hooks that keep `Liveness.phase` and `step_started` current: a forward pre-hook (run
    before FSDP's, whose all-gather may block), a gradient hook on the model's output (the
    backward has begun), and the optimizer's step hooks. Collectives are marked by the comms
    wrappers (comms.py)."""

    def __init__(self, model: nn.Module, live: Liveness) -> None:
        self.live = live
        self._owned = OptimizerParams(list(model.parameters()))
        self._handles = [
            model.register_forward_pre_hook(self._forward, prepend=True),
            model.register_forward_hook(self._output),
            register_optimizer_step_pre_hook(self._optimizer(True)),
            register_optimizer_step_post_hook(self._optimizer(False)),
        ]

    def _forward(self, _module: nn.Module, _args: Any) -> None:
        if torch.is_grad_enabled():  # an evaluation under no_grad is not the step's
            self.live.step_started = self.live.current_step
            self.live.phase = "forward"

    def _output(self, _module: nn.Module, _args: Any, output: Any) -> None:
        out = first_float_tensor(output)
        if out is not None and out.requires_grad:
            # An output autograd cannot hook: the phase stays "forward" until the optimizer.
            with contextlib.suppress(RuntimeError):
                out.register_hook(self._backward)

    def _backward(self, _grad: torch.Tensor) -> None:
        self.live.phase = "backward"  # on autograd's thread, once the output's gradient is in

    def _optimizer(self, starting: bool):
        def hook(optimizer: torch.optim.Optimizer, *_: Any) -> None:
            if self._owned.positions(optimizer):  # the hooks are global: only our model's
                self.live.phase = "optimizer" if starting else "data_wait"

        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()


class HeartbeatSender:
    """POSTs this rank's heartbeat to `{url}/api/v1/heartbeats` every `interval_s`."""

    def __init__(
        self,
        url: str,
        run_id: str,
        rank: int,
        live: Liveness,
        interval_s: float = 2.0,
        token: str | None = None,
        timeout_s: float | None = None,
        last_words: Callable[[], Any] | None = None,
    ) -> None:
        import httpx

        self.endpoint = url.rstrip("/") + "/api/v1/heartbeats"
        self.run_id, self.rank, self.live = run_id, rank, live
        self.host = socket.gethostname()
        self.interval_s = interval_s
        headers = {"content-type": "application/json"}
        if token is None:  # the collector's own variable for its write token
            token = os.environ.get("TRAINVITALS_INGEST_TOKEN", "")
        if token:
            headers["authorization"] = f"Bearer {token}"
        # One attempt may not outlast the interval: the next heartbeat is the retry.
        self._client = httpx.Client(timeout=timeout_s or min(interval_s, 2.0), headers=headers)
        self._client_lock = threading.Lock()  # httpx.Client: the thread and close() share it
        self.sent = 0
        self.failed = 0  # heartbeats not delivered (collector away, refused, timed out)
        self._pauses_refused = False  # the collector predates declared pauses (send)
        self._stop = threading.Event()
        self._closed = False
        # Called before "exited" on an end without close(): the monitor's export flush,
        # while heartbeats go on (a drain must not look like a silent rank).
        self._last_words = last_words
        self._thread = threading.Thread(
            target=self._loop, name="trainvitals-heartbeat", daemon=True
        )
        self._thread.start()
        atexit.register(self._exiting)
        self._sigterm = _on_sigterm(self._terminated)

    def _loop(self) -> None:
        while True:
            self.send()
            if self._stop.wait(self.interval_s):
                return

    def send(self, phase: str | None = None) -> bool:
        """One heartbeat now (of `phase`, else the training thread's); True if stored."""
        live = self.live
        phase = phase or live.phase
        if self._pauses_refused and phase in PAUSES:
            phase = "data_wait"  # what the collector knew a pause between steps as
        cols = {
            "rank": [self.rank],
            "time_unix_s": [time.time()],
            "host": [self.host],
            "step_started": [live.step_started],
            "step_finished": [live.step_finished],
            "phase": [phase],
        }
        body = orjson.dumps(
            {"schema_version": SCHEMA_VERSION, "run_id": self.run_id, "heartbeats": cols}
        )
        try:
            with self._client_lock:
                resp = self._client.post(self.endpoint, content=body)
            ok = resp.status_code < 300
            if resp.status_code == 422 and phase in PAUSES and "heartbeats.phase" in resp.text:
                # A collector older than declared pauses: say data_wait from now on (a
                # refused heartbeat would leave the rank silent, and lost, for the pause).
                log.warning("the collector does not know declared pauses: sent as data_wait")
                self._pauses_refused = True
                return self.send("data_wait")
            if not ok and resp.status_code < 500:
                log.error("collector refused a heartbeat (%s): %s", resp.status_code, resp.text)
        except Exception as e:  # never into training: counted, and the next one tries again
            log.debug("heartbeat to %s failed: %s", self.endpoint, e)
            ok = False
        if ok:
            self.sent += 1
        else:
            self.failed += 1
        return ok

    def close(self, phase: str = "ended", timeout_s: float = 5.0) -> None:
        """Stop the thread and send a last heartbeat of `phase`. A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._exiting)
        if self._sigterm is not None and signal.getsignal(signal.SIGTERM) == self._terminated:
            signal.signal(signal.SIGTERM, self._sigterm)  # as it was before us
        self._stop.set()
        self._thread.join(timeout_s)
        self.send(phase)
        with self._client_lock:
            self._client.close()

    def _exiting(self) -> None:
        """atexit without close(): the process is ending on an error; its last word."""
        self._say_last_words()
        self.close("exited", timeout_s=1.0)

    def _terminated(self, signum: int, _frame: Any) -> None:
        """SIGTERM (torchrun tearing the job down after another rank failed): say so, then
        die of it as the default action would."""
        self._say_last_words()
        self.close("exited", timeout_s=1.0)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def _say_last_words(self) -> None:
        """`last_words` on a thread of its own, waited for LAST_WORDS_MAX_S at most: a
        SIGTERM handler interrupts the training thread anywhere, inside a queue's lock too,
        and the process must still say "exited" and die."""
        if self._last_words is None or self._closed:
            return
        speaker = threading.Thread(target=self._speak, name="trainvitals-last-words", daemon=True)
        speaker.start()
        speaker.join(LAST_WORDS_MAX_S)

    def _speak(self) -> None:
        try:
            self._last_words()
        except Exception:  # the process is ending: its last heartbeat must still go
            log.exception("trainvitals: the export flush at exit failed")


def _on_sigterm(handler: Any) -> Any:
    """Install `handler` for SIGTERM if the process left it at the default (which dies
    without a word, atexit included) and this is the main thread; returns what was there
    (None: not installed). A handler of the program's own is left alone."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        return None
    return signal.signal(signal.SIGTERM, handler)


class NullHeartbeat:
    """No collector to send heartbeats to."""

    sent = failed = 0

    def close(self, phase: str = "ended", timeout_s: float = 5.0) -> None:
        pass
