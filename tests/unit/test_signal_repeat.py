"""A stop signal repeated within REPEAT_WINDOW_S is the same request (a group signal reaches a rank directly and
again through its launcher); a second signal after the window still stops at once."""

import os
import signal

import pytest

from spmd_rl.runtime import signals
from spmd_rl.runtime.errors import StopSignal


@pytest.fixture
def handlers():
    saved = {signum: signal.getsignal(signum) for signum in signals.STOP_SIGNALS}
    signals.install_signal_handlers()
    signals.stop_at_iteration_boundary(True)
    yield
    signals.stop_at_iteration_boundary(False)
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_a_repeat_within_the_window_is_the_same_request_and_after_it_a_stop_at_once(handlers, monkeypatch):
    os.kill(os.getpid(), signal.SIGINT)  # a terminal's Ctrl-C to the group ...
    os.kill(os.getpid(), signal.SIGTERM)  # ... and torchrun's agent passing it on as SIGTERM
    os.kill(os.getpid(), signal.SIGINT)
    assert signals.requested_stop() == ("SIGINT", signal.SIGINT)
    monkeypatch.setattr(signals, "REPEAT_WINDOW_S", 0.0)  # as if the person pressed it again later
    with pytest.raises(StopSignal):
        os.kill(os.getpid(), signal.SIGTERM)
