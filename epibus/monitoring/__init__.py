"""What a node tells its operator: the health report (`health.json`), the status snapshot the statusline reads without
a network (status, statusline), `epibus status` (status_report), the Prometheus metrics and their endpoint, and the
one way a node or tool serves HTTP (http_serving)."""
