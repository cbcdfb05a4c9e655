"""The event model and its pure rules: the envelope and the body of each kind (event, kinds, fields), the
closed vocabularies (vocab), ids and the point-id function (ids), the transition table and the decision every
path applies (state), who may do what (authority), lineage and rollback planning, erasure records, the content
hash of tombstones, enrolment records and broker permissions (auth, records), and the request and reply models
of node services (requests). No I/O: nothing here opens a connection, a file or a store.

Imports: nothing of bus but errors and subjects."""
