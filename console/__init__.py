"""The operations console (Textual TUI over the daemon's socket).

It imports nothing of the engine, the runner or torch, so that it starts fast
over SSH; it only talks to the daemon through gpuservd.api.client.
"""
