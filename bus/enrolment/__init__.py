"""Who is enrolled and what a request may do: the agent registry in its KV bucket (registry), an agent's view
of the fleet's enrolments (enrolment_view), the one cache of recent answers every guard shares (recent), and
the guard every node service applies to a signed request, one rule per service (service_rules).

Imports: model, host, identity, broker."""
