"""What needs NVIDIA hardware: device readings (NVML), green contexts, SM-partition backends.

Without a CUDA device every piece here says so (a reason in the reading, a backend
whose summary reads "not enforced (no CUDA device)"); none of it pretends. Importing
this package imports neither torch nor pynvml: the modules do, when asked.
"""
