"""A fleet across machines: the hub's side (hub), invites (invites), a joining node's side (join), the fleet CA and
certificates (certs), and what `epibus doctor` checks of a fleet (doctor)."""
