"""A fake vLLM engine for r1sup's tests and benchmarks: vLLM 0.32's command line, start-up memory accounting,
log lines and failure tracebacks on a simulated GPU, and an OpenAI-compatible HTTP server.

- :mod:`fakevllm.engine`: the process (``python -m fakevllm``); its docstring documents the scenario format.
- :mod:`fakevllm.memory`: the accounting shared by the engine and :mod:`fakevllm.optimum`.
- :mod:`fakevllm.optimum`: ``feasible(scenario, flags)`` and the exhaustive ``optimum(...)`` search.

Standard library only; nothing here imports r1sup.
"""

# The vLLM version whose command line and messages it imitates (a scenario may print another one in its
# banner). r1sup's preflight imports the package ``server.launch`` runs and reads this, as it reads
# ``vllm.__version__``.
__version__ = "0.32.0"
