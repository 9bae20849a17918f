"""Tests moved from test_reliability_writes.py."""
import signal

import pytest


def test_signals_are_noted_and_passed_on():
    from clover_lab.signals import NotedSignals

    with NotedSignals() as noted:
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGTERM)
    assert noted.names == "SIGINT, SIGTERM"
    with pytest.raises(KeyboardInterrupt), NotedSignals(second_raises=True):  # the user insists
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)
    done = []
    with pytest.raises(KeyboardInterrupt), NotedSignals(redeliver=True):  # a commit's renames: after them
        signal.raise_signal(signal.SIGINT)
        done.append(True)
    assert done == [True] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job ignores Ctrl-C: still ignored
    try:
        with NotedSignals() as noted:
            signal.raise_signal(signal.SIGINT)
        assert not noted
    finally:
        signal.signal(signal.SIGINT, previous)
