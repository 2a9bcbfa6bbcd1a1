"""A dependency that is down is logged once, then reminded at intervals, then its recovery: not every retry."""

from __future__ import annotations

import logging

from engine.outage import OutageLog


def test_a_registry_down_for_a_minute_is_three_lines_not_two_hundred(caplog):
    now = [0.0]
    log = OutageLog(logging.getLogger("pdserve.test"), "heartbeat to the registry", every_s=30.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="pdserve.test"):
        for beat in range(240):  # 0.25 s apart: a minute down
            now[0] = beat * 0.25
            log.failed(ConnectionError("connection refused"))
        now[0] = 60.0
        log.ok()
        log.ok()  # working, and nothing to say
        log.failed(ConnectionError("down again"))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "heartbeat to the registry failed: connection refused",
        "heartbeat to the registry still failing after 30 s (121 attempts): connection refused",
        "heartbeat to the registry works again after 60 s (240 failed attempts)",
        "heartbeat to the registry failed: down again",
    ]
