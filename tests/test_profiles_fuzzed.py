"""A saved profile fuzzed with hypothesis: used within the bounds, or set aside; never raises.

Apart from test_profiles.py because other tests import that module's helpers, and the installed-wheel
run (make test-wheel) has no hypothesis."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from r1sup.core import config as cfg
from r1sup.core.figures import out_of_bounds
from r1sup.core.flags import EngineFlags
from r1sup.core.hardware import GIB
from r1sup.state.profiles import ProfileStore
from test_profiles import _probed, events

_NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 1e300, 1e308, -1e308, 2**63, 2**64, 1e10, 0.5]),
)
_JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), _NUMBERS, st.text(max_size=20)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
_FIELDS = {
    "flags": [f.name for f in dataclasses.fields(EngineFlags)],
    "observations": [
        "weights_gib",
        "kv_cache_gib",
        "gpu_blocks",
        "max_model_len",
        "engine_init_s",
        "cudagraph_gib",
    ],
    "probe": ["ok", "prompt_tokens", "output_tokens", "concurrency", "requests", "output_tokens_per_s"],
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    changes=st.lists(
        st.tuples(st.sampled_from(sorted(_FIELDS)), st.integers(0, 9), st.one_of(_NUMBERS, _JSON)), max_size=4
    )
)
def test_fuzzed_profiles_are_used_within_the_bounds_or_set_aside(tmp_path: Path, changes: list[Any]) -> None:
    data = _probed()
    for section, index, value in changes:
        names = _FIELDS[section]
        data[section][names[index % len(names)]] = value
    store = ProfileStore(tempfile.mkdtemp(dir=tmp_path))
    path = store.path_for(data["key"])
    path.parent.mkdir(mode=0o700, parents=True)
    path.write_text(json.dumps(data, allow_nan=True))
    with capture_logs() as logs:
        profile = store.load(data["key"])
    if profile is None:
        (event,) = events(logs, "state_file_set_aside")
        assert "\n" not in event["reason"]
        return
    for name, value in profile.flags.items():
        cfg.check_start_value(f"flags.{name}", name, value)  # within what a launch takes
    argv = profile.engine_flags.to_argv()
    assert all(len(a) < 40 for a in argv), argv
    for name, value in profile.observations.to_dict().items():
        assert out_of_bounds(name, value) is None
        assert int(value * GIB) * 2 >= -(2**80)  # the memory model's arithmetic: no OverflowError
    if profile.engine_flags.max_model_len is not None:
        assert profile.engine_flags.max_model_len >= 2
