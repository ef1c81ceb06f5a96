"""Troubleshooting hints (symptom -> likely cause -> action): rules over step records, events and device readings.

`rule.py` (the Rule, its thresholds and inputs), `rules_sched.py`,
`rules_device.py`, `rules_cache.py` (the rules), `window.py` (what they look
at), `monitor.py` (the daemon's sliding window and once-a-second evaluation).
"""
