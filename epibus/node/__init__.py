"""The node: `epibus up` wires an embedded nats-server (or a URL to join), the journal and mirror with their observers,
the outbox forwarder, the request services, the mesh and the coordinators (node), from its configuration (config),
its connection, mirror, fleet membership and supervision, recovery after a crash, the failpoints chaos arms, agents'
budgets, and the view health, metrics and the dashboard read (view)."""
