"""The agent's side: `EpibusClient` (client) composed of its parts: the connection, placement and enrolment
requests (connection, placement, enrol), pre-publish checks (prechecks), the publish pipeline and dispatch,
project views and state changes with compare-and-set (project_view, changes), recall across the fleet (recall)
and fleet requests (fleet).

Imports: model, host, identity, broker, enrolment, intake, outbox, services."""
