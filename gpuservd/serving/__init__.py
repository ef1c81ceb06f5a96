"""The serving layer: what the daemon serves and how.

`serving.py` admits requests and streams their outputs (and drains);
`models.py` hosts the models (slots, loads, eviction, device routing,
prefetch), with `model_workers.py` for models in engine worker processes;
`request_stream.py` is one admitted request on the event loop side;
`routing.py` picks a request's version and a load's device; `tenants.py` maps
a peer to its tenant and limits; `daemon_config.py` is the daemon's config
file. Nothing here is imported by the layers below (engine, weights, runner).
"""
