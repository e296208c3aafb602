"""The pure core: plain data in, plain data out.

The memory model, the search with its bounds, policy, blind and naive steps, the planner, the engine
flags, the catalogs, the settings' declarations, the failure vocabulary and exit codes, the load probe's
result (``probing``) and the capacity it proves, the loop's event types, liveness judgement, progress
and the log reader (``logparse``). A core module imports only the
standard library and other core modules: no processes, sockets, devices, clock or files
(``tests/test_architecture.py`` lists what that excludes and the one documented exception).
"""
