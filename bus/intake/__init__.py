"""Everything that takes events off the stream passes here: admission (bytes, subject, signature, registered
key, time bounds; what is refused and why), the batch context it decides with (enrolments and erasures as they
stood), the consumer runner observers share (runner), replay and dead letters (reader), a follower (follow),
and reading through consumers a node opens for an agent (consumers, stream_read).

Imports: model, host, identity, broker, enrolment."""
