"""The bus layer: the event model, ids, subjects, signing, the client with its outbox, the consumer runner
and the embedded nats-server. It imports neither `observers` nor `mesh`."""
