"""The worker front: the process of a worker node that talks to Redis (arq jobs, events, heartbeats, leases,
failover, metrics) and drives one engine core process (``engine.core``) over ZMQ.

It has its own package so that ``engine/`` holds only the engine and imports no Redis, arq or ``wire``: the
offline ``LLM`` and the core process never load the serving tier, and this package never steps a model.
"""
