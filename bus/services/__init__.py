"""Request services a node runs: the responder every service answers through, the consumer slots it opens
for agents, the tombstone registry, the enrolment service that records and applies enrolment changes, and the
erase service behind forget.

Imports: model, host, identity, broker, enrolment, intake, outbox."""
