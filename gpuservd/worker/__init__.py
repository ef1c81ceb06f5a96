"""Engine worker processes (`engine.isolation: process`, and every model under the mps backend).

build.py: the WorkerSpec and the engine construction shared with engine threads;
__main__.py: the worker process itself; proxy.py: the daemon's side (WorkerLoop).
"""
