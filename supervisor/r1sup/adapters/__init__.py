"""Adapters: the code that touches the world.

Starting and stopping vLLM (``launcher``), the load probe, NVML and the CPU view of the devices, what is
known of the box and the model before a search (``knowledge``), the preflight, HTTP health checks and
vLLM's metrics, r1sup's own endpoint and metrics, sd_notify, logging, the state directory's safe files,
the API key file. Adapters may import the core; never ``state``, ``supervision`` or ``cli``.
"""
