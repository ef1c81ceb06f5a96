"""The dataclasses that cross the HTTP boundary: a validated generation request (generation.py) and
what /admin/status reports (status.py).

Pure data, no torch and no I/O. They sit below every layer so that `api/` makes and reads them and
serving and the models take and return them, each importing only downward: the API layer parses
and renders, serving never imports `api/`.
"""
