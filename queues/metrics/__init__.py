"""Prometheus metrics, served at /metrics (see docs/metrics.md).

    families     every metric this process exports, in a registry of its own (the HTTP request
                 durations are observed with the access log, in queues/access.py)
    transitions  the store's observer: counts items posted, claimed, given back and ended
    gauges       the queue gauges (read from the data directory, kept a while) and workers connected
    (workers connected come from the dashboard's roster, queues/roster.py)
    views        the /metrics endpoint: a token with the metrics right, or staff
"""
