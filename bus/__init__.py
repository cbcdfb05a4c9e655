"""The bus layer, in floors that import only the floors below them: model (the event and its pure rules),
host (the node's files and its nats-server), identity (keys and signatures), broker (the NATS adapter),
enrolment (the registry and the guard of node services), intake (admission and the consumer runner), outbox
(publishing), services (what a node answers) and client (the agent's side). `errors` and `subjects` serve
every floor. It imports neither `observers` nor `mesh`."""
