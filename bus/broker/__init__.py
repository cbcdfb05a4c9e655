"""The one adapter to NATS: every NATS error translated at one choke point (`nats_errors.nats_call`), the
streams and buckets and their drift check (streams, drift), requests with a deadline and the fan-out to every
answering node (ask), node heartbeats (presence), the one pull loop (polling), stopping long-lived loops
(loops) and capped counts (tally).

Imports: model, host, identity."""
