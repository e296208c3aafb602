"""One timestamp function: ``Z`` in the state files, ``+00:00`` in the daemon's state and events, both
read back by ``parse_iso``."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

import pytest

from r1sup.adapters.statefiles import parse_iso, utc_name_stamp, utc_now_iso

AT = datetime(2026, 12, 2, 14, 0, 0, 750000, tzinfo=timezone.utc)


@pytest.mark.parametrize(
    ("offset_s", "zulu", "expected"),
    [
        (0.0, True, "2026-12-02T14:00:00Z"),
        (0.0, False, "2026-12-02T14:00:00+00:00"),
        (-95.0, False, "2026-12-02T13:58:25+00:00"),
        (70.4, False, "2026-12-02T14:01:11+00:00"),  # 14:00:00.75 + 70.4 s, cut to the second
        (-3600.0, True, "2026-12-02T13:00:00Z"),
    ],
)
def test_one_stamp_two_spellings(offset_s: float, zulu: bool, expected: str) -> None:
    text = utc_now_iso(offset_s, zulu=zulu, now=AT)
    assert text == expected
    assert parse_iso(text) == datetime.fromisoformat(expected.replace("Z", "+00:00"))


def test_the_clock_by_default() -> None:
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", utc_now_iso())
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", utc_now_iso(zulu=False))


def test_the_name_stamp_is_the_same_instant_without_separators() -> None:
    local = AT.astimezone(timezone(timedelta(hours=-5)))  # any zone in, UTC out
    assert utc_name_stamp(local) == "20261202T140000Z"
    assert utc_name_stamp(local) == re.sub(r"[-:]", "", utc_now_iso(now=local))
