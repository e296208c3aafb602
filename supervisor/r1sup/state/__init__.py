"""State: what r1sup remembers between runs.

Profiles (the working configurations, by fingerprint), the fleet's shared profile store, run records,
the does-not-fit verdicts and the memory model's calibration from saved profiles, all read as untrusted
input and written atomically through ``adapters.statefiles``. State may import adapters and the core;
never ``supervision`` or ``cli``.
"""
