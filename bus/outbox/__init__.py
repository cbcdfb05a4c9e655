"""Publishing: the local outbox (SQLite, synchronous=FULL) and its file, the forwarder that drains it on
reconnect with the same Nats-Msg-Id, the publish call and its retries, the signer that seals rows, and the
receipts that report the level an event reached (outboxed, published, journaled, indexed).

Imports: model, host, identity, broker, enrolment, intake."""
