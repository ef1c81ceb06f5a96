"""gpuserv: a single-node model-serving daemon (engine, daemon, admin API)."""

__version__ = "0.1.0"
